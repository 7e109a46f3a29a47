"""PagedKVCache: one worker's preallocated KV pool.

Layout (head-major, so one sequence's blocks gather into a tensor attention can use
without another copy)::

    k, v: [num_layers, kv_heads, num_blocks * block_size, head_dim]

i.e. per layer ``[kv_heads, num_blocks, block_size, head_dim]`` with the block dims
flattened into token slots; slot ``b * block_size + i`` is token ``i`` of block ``b``.

Where the pool's memory comes from is a PoolMemory: private memory by default (huge pages
on CPU); the KV transfer provides pools a same-node peer can map (kv_transfer/shm_backend.py:
a shared-memory file; kv_transfer/cuda_ipc_backend.py: CUDA-IPC exportable allocations).
The engine knows nothing of transports.
"""

from __future__ import annotations

import mmap
import os

import torch

from pdserve.engine import huge_pages
from pdserve.kv_layout import KVSpec


def pool_shape(spec: KVSpec, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
    """The shape of k (and of v): [num_layers, kv_heads, num_blocks * block_size, head_dim]."""
    return (spec.num_layers, spec.num_kv_heads, num_blocks * block_size, spec.head_dim)


class PoolMemory:
    """Where a KV pool lives: this base allocates private memory. A subclass that a peer on
    the same node can map sets ``shm_path`` (a file) or ``ipc_handles`` (CUDA IPC handles of
    k and v), which the sender hands out."""

    shm_path: str | None = None
    ipc_handles: tuple[bytes, bytes] | None = None

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Zeroed (k, v) of ``shape`` on ``device``."""
        if device.type == "cpu":  # huge pages: a decode step reads scattered blocks of it (huge_pages.py)
            return huge_pages.zeros(shape, dtype), huge_pages.zeros(shape, dtype)
        return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)

    def close(self) -> None:
        """Give back what outlives the process (a file); mappings stay valid until unmapped."""


class SharedPoolMemory(PoolMemory):
    """A KV pool in the shared-memory file ``path`` (k then v), made when the pool is
    allocated and removed at ``close``: what a same-node peer maps (``map_pool_file``): a
    KV receiver (kv_transfer's shm backend) or the engine's own tensor-parallel ranks."""

    def __init__(self, path: str, spec: KVSpec, num_blocks: int, block_size: int):
        self.shm_path, self._layout = path, (spec, num_blocks, block_size)

    def allocate(self, shape, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Raises OSError if the file cannot be made at the pool's size."""
        return map_pool_file(self.shm_path, *self._layout, create=True)

    def close(self) -> None:
        try:
            os.unlink(self.shm_path)
        except FileNotFoundError:
            pass


def map_shared_file(path: str, nbytes: int, create: bool = False, populate: bool = False) -> mmap.mmap:
    """Map the file ``path`` of ``nbytes`` bytes shared and writable. ``create`` makes it
    (mode 0600, zero-filled; it must not exist); otherwise it must exist with exactly that
    size. ``populate`` maps every page now. Raises OSError, or ValueError on a size mismatch."""
    fd = os.open(path, (os.O_RDWR | os.O_CREAT | os.O_EXCL) if create else os.O_RDWR, 0o600)
    try:
        if create:
            os.ftruncate(fd, nbytes)
        elif os.fstat(fd).st_size != nbytes:
            raise ValueError(f"{path} holds {os.fstat(fd).st_size} bytes, not the expected {nbytes}")
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
        return mmap.mmap(fd, nbytes, flags, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def map_pool_file(path: str, spec: KVSpec, num_blocks: int, block_size: int, create: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Map a pool file as (k, v), each [num_layers, kv_heads, num_blocks * block_size, head_dim].

    ``create`` makes the file (zero-filled, pages allocated on first touch); otherwise
    it must exist with exactly the pool's size. Raises OSError (or ValueError on a size mismatch).
    """
    shape = pool_shape(spec, num_blocks, block_size)
    numel = shape[0] * shape[1] * shape[2] * shape[3]
    nbytes = 2 * numel * spec.dtype.itemsize
    # populate now, as torch.zeros does for a private pool: the creator allocates every page
    # (else a reader's first transfer would allocate them, seconds for a large pool), and a
    # reader maps them all at once (else it faults per 4 KB page in the middle of a copy)
    buf = map_shared_file(path, nbytes, create, populate=True)
    flat = torch.frombuffer(buf, dtype=spec.dtype)  # keeps buf alive
    return flat[:numel].view(shape), flat[numel:].view(shape)




class PagedKVCache:
    def __init__(self, spec: KVSpec, num_blocks: int, block_size: int, device: str | torch.device = "cpu",
                 memory: PoolMemory | None = None):
        """``memory``: where the pool lives (PoolMemory; private memory by default). Raises
        what its ``allocate`` raises (OSError for a shared-memory file that cannot be made)."""
        self.spec = spec
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = torch.device(device)
        self.memory = memory or PoolMemory()
        self.k, self.v = self.memory.allocate(pool_shape(spec, num_blocks, block_size), spec.dtype, self.device)

    @property
    def shm_path(self) -> str | None:
        """The shared-memory file a same-node peer maps, if the pool lives in one."""
        return self.memory.shm_path

    @property
    def ipc_handles(self) -> tuple[bytes, bytes] | None:
        """CUDA IPC handles of k and v, if the pool is exportable."""
        return self.memory.ipc_handles

    def close(self) -> None:
        self.memory.close()

    @staticmethod
    def num_blocks_for(spec: KVSpec, block_size: int, num_tokens: int | None = None, num_bytes: int | None = None) -> int:
        """Blocks that fit ``num_tokens`` tokens or ``num_bytes`` bytes (bytes win)."""
        if num_bytes is not None:
            num_tokens = num_bytes // spec.bytes_per_token
        if not num_tokens or num_tokens < block_size:
            raise ValueError(f"the KV pool must hold at least one block of {block_size} tokens")
        return num_tokens // block_size

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def blocks(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of one layer as ``[kv_heads, num_blocks, block_size, head_dim]``."""
        shape = (self.spec.num_kv_heads, self.num_blocks, self.block_size, self.spec.head_dim)
        return self.k[layer].view(shape), self.v[layer].view(shape)

    def slots(self, block_table: list[int], start: int, end: int) -> torch.Tensor:
        """Slot index of each token position in [start, end): LongTensor [end - start]."""
        positions = torch.arange(start, end, device=self.device)
        table = torch.tensor(block_table, dtype=torch.long, device=self.device)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) of the given slots: each [kv_heads, len(slots), head_dim] (a copy)."""
        return self.k[layer][:, slots], self.v[layer][:, slots]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k, v: [kv_heads, len(slots), head_dim]`` (on any device) into the given slots."""
        self.k[layer].index_copy_(1, slots.to(self.device), k.to(self.device))
        self.v[layer].index_copy_(1, slots.to(self.device), v.to(self.device))

    def read_blocks(self, layer: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) of whole blocks ``block_ids`` (LongTensor on this pool's device): each a new
        ``[kv_heads, len(block_ids) * block_size, head_dim]`` tensor, one index_select per pool."""
        out = []
        for pool in (self.k[layer], self.v[layer]):
            blocks = torch.index_select(block_rows(pool, self.num_blocks), 1, block_ids)
            out.append(blocks.view(pool.dtype).view(pool.shape[0], -1, pool.shape[2]))
        return out[0], out[1]

    def write_blocks(self, layer: int, block_ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store whole blocks: ``k, v: [kv_heads, len(block_ids) * block_size, head_dim]`` (on
        any device) into blocks ``block_ids`` (LongTensor on this pool's device), one
        index_copy_ per pool whatever the blocks' order."""
        for pool, src in ((self.k[layer], k), (self.v[layer], v)):
            block_rows(pool, self.num_blocks).index_copy_(1, block_ids, block_rows(src.to(self.device).contiguous(), len(block_ids)))


    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy each (source, destination) block's KV, every layer (a fork's copy-on-write)."""
        if not pairs:
            return
        src = torch.tensor([a for a, _ in pairs], dtype=torch.long, device=self.device)
        dst = torch.tensor([b for _, b in pairs], dtype=torch.long, device=self.device)
        for layer in range(self.spec.num_layers):
            for pool in (self.k[layer], self.v[layer]):
                rows = block_rows(pool, self.num_blocks)
                rows.index_copy_(1, dst, torch.index_select(rows, 1, src))


def block_rows(t: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """[kv_heads, num_blocks * block_size, head_dim] (or [kv_heads, num_blocks, block_size,
    head_dim]) -> [kv_heads, num_blocks, block words], a view of a contiguous ``t``. 16-bit
    data is taken as 32-bit words, which index_select and index_copy_ move ~2x faster here
    (0.8 vs 1.5 ms for 6 MB). Every whole-block copy of the pool goes through it: the
    pool's read_blocks/write_blocks (the KV transfer)."""
    rows = t.view(t.shape[0], num_blocks, -1)  # a view, never a copy: index_copy_ must land in t
    return rows.view(torch.float32) if t.element_size() == 2 and rows.shape[-1] % 2 == 0 else rows
