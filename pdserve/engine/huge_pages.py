"""Large CPU tensors on transparent huge pages (2 MiB), for memory a decode step streams.

A decode step reads every linear layer's weights and each sequence's KV blocks once. With
4 KiB pages that is one TLB entry per 4 KiB read, and the KV of a batch is scattered over
thousands of pages. Linux backs an anonymous mapping with 2 MiB pages where the mapping is
advised ``MADV_HUGEPAGE`` before it is touched (``/sys/kernel/mm/transparent_hugepage/enabled``
= ``madvise``, the common default; ``always`` needs no advice). Measured on one Zen 4 core,
interleaved runs in one process: the bundled model's GEMVs at batch 1 (269 MB) 11.2 -> 10.7
ms at best, 13.2 -> 12.1 ms median; decode attention at batch 32, context 512, blocks in random
order, 30 layers: 31.3 -> 30.0 ms, and 32.9 -> 30.5 ms median with the L2 prefetches of
the attention kernels in cpu/ (attention.c). Results are bit-identical: only the page size changes.

Where the advice is refused (another OS, THP ``never``), the memory is plain anonymous memory.

The cost is at start: every 2 MiB page is faulted in when ``zeros`` writes it. On a bare
machine that is a memset; in a VM whose host reclaims the guest's free memory (a balloon with
free page reporting, as on the 2-core EPYC sandboxes) each page also faults on the host. There,
2026-12-03, an engine's float32 KV pool of 32,768 tokens (1.5 GB) and packed weights (0.54 GB)
took 12-16 s to map, against 1.5 s on 4 KiB pages.
"""

from __future__ import annotations

import mmap
import sys

import torch

HUGE_PAGE = 2 << 20  # bytes
MIN_BYTES = 4 * HUGE_PAGE  # smaller tensors keep torch's allocator


def zeros(shape: int | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor of ``shape`` whose memory is a fresh anonymous mapping, 2 MiB
    aligned, advised for huge pages and then written (so resident, as ``torch.zeros``'s). Below
    ``MIN_BYTES``, or off Linux, it is ``torch.zeros``. The mapping lives as long as the tensor
    (and its views); its storage is the whole mapping (2 MiB more than the tensor), so a
    pickled copy carries that too. Raises ValueError on a negative dimension."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    if any(n < 0 for n in shape):
        raise ValueError(f"huge_pages.zeros: negative dimension in {shape}")
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes < MIN_BYTES or not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    flat = torch.frombuffer(buf, dtype=torch.uint8)  # holds buf: the tensor keeps the mapping alive
    offset = -flat.data_ptr() % HUGE_PAGE  # first 2 MiB boundary inside the mapping (a page multiple)
    try:
        buf.madvise(mmap.MADV_HUGEPAGE, offset, nbytes)
    except OSError:  # THP off or unsupported: plain pages
        pass
    out = flat[offset : offset + nbytes]
    out.zero_()  # touch every page now, as torch.zeros does: the pool is resident from the start, and never read
    # through the kernel's shared zero page (a benchmark reading blocks never written would see cached zeros)
    return out.view(dtype).view(shape)


def gather(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of ``tensors`` (CPU, any dtype and shape) side by side in one ``zeros`` mapping,
    each at a 64-byte boundary, in the order given: a decode step that reads them in that
    order streams one run of huge pages. Returns views of the shared mapping, in the same
    order (the mapping lives while any of them does). Where they add up to less than
    ``MIN_BYTES``, they are returned as they are.

    Why: a single core streams the bundled model's packed weights at 21.6-26.4 GB/s on 4 KiB
    pages and 29.5-32.0 GB/s on 2 MiB pages (one 226 MB bf16 GEMV, medians and bests of 7,
    AMD EPYC Zen 4, 2026-12-03); its batch-1 decode step went 11.9 -> 10.3 ms."""
    sizes = [-(-t.numel() * t.element_size() // 64) * 64 for t in tensors]
    if sum(sizes) < MIN_BYTES:
        return list(tensors)
    arena = zeros(sum(sizes), torch.uint8)
    out, offset = [], 0
    for t, size in zip(tensors, sizes):
        view = arena[offset : offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        view.copy_(t)
        out.append(view)
        offset += size
    return out


class Arena:
    """One reserved run of huge pages that tensors are carved from in order, each at a
    64-byte boundary: a model's packed weights written straight into the run a decode step
    streams (what ``gather`` gives), with no second copy at load. ``capacity`` bytes are
    reserved as address space only (``MAP_NORESERVE``): a page becomes resident when a tensor
    taken from it is first written, so an over-estimate costs no memory. Off Linux, or where
    the mapping is refused, every ``take`` returns None (the caller allocates as usual)."""

    def __init__(self, capacity: int):
        self.capacity, self.used, self._flat = capacity, 0, None
        if capacity < MIN_BYTES or not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
            return
        try:
            buf = mmap.mmap(-1, capacity + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0))
        except OSError:
            return
        flat = torch.frombuffer(buf, dtype=torch.uint8)
        offset = -flat.data_ptr() % HUGE_PAGE
        try:
            buf.madvise(mmap.MADV_HUGEPAGE, offset, capacity)
        except OSError:
            pass
        self._flat = flat[offset : offset + capacity]

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """A 1-D tensor of ``numel`` elements (zeros until written) from the run, or None where
        the run has no room left."""
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if self._flat is None or self.used + nbytes > self.capacity:
            return None
        out = self._flat[self.used : self.used + nbytes].view(dtype)
        self.used += -(-nbytes // 64) * 64
        return out

    def give_back(self, t: torch.Tensor) -> None:
        """Return the last tensor taken (a packed weight not kept): the next ``take`` reuses its
        pages. An earlier one stays where it is."""
        if self._flat is not None and self.holds(t):
            start = t.data_ptr() - self._flat.data_ptr()
            if start + -(-t.numel() * t.element_size() // 64) * 64 == self.used:
                self.used = start

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s memory lies in this arena."""
        if self._flat is None:
            return False
        start = self._flat.data_ptr()
        return start <= t.data_ptr() < start + self.capacity
