"""Decode rows of a batched step summed as the reference's one-token forward sums them.

The reference (``model.generate``) decodes one token per forward, so each bf16 linear layer
runs oneDNN's GEMV (M = 1). A batched decode step runs oneDNN's GEMM (M = batch), which sums
some layers in another order: on this CPU the 1,536-wide MLP input (``down_proj``) gives
about one row in ten a different output bit. ``kernels/bf16_gemv.c`` computes many rows
against one weight with oneDNN's GEMV order (blocks of 512, VDPBF16PS pairs), so every row
of a batched step gets the bits it would get alone.

``prepare(model)`` checks each layer shape on random data whose sums round differently in
different orders. Where the kernel reproduces oneDNN's GEMV bit for bit (every shape of the
bundled model here) it takes the decode rows: always where oneDNN's GEMM would sum them
otherwise (``down_proj``), on one torch thread always, and with more threads (where oneDNN's
GEMM runs on all of them, the kernel on one) in steps of at most ``FEW_ROWS`` decode rows.
Measured on one AVX512-BF16 core (Zen 4, 2026-12-01, bundled model's layer shapes, weights in
cache): batch 1 streams the weights at 31-68 GB/s where oneDNN's GEMV reaches 8-33; batch 32
runs at 174-213 GFLOP/s, 74-91% of the core's VDPBF16PS peak (234 GFLOP/s: one 512-bit
instruction per cycle), where oneDNN's GEMM on one thread reaches 120-177. Its model's
linear layers take 5.6 / 13.0 / 43.3 ms at batch 1 / 8 / 32, oneDNN's 13.0 / 18.1 / 47.5.
The runner marks which rows of a step are decode rows (``AttentionContext.gemv_rows``).
"""

from __future__ import annotations

import functools
import logging

import torch

from pdserve.engine import huge_pages, kernels

log = logging.getLogger(__name__)

FEW_ROWS = 8  # up to this many decode rows, the kernel beats oneDNN's GEMM on all its threads here


def available() -> bool:
    lib = kernels.load("bf16_gemv")
    return lib is not None and bool(lib.bf16_gemv_available())


def pack(weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """weight: [N, K] bf16 -> [N * K / 2] int32 pairs (W[n, 2i] low, W[n, 2i + 1] high) in tiles
    of 64 outputs, each [K / 2, 64] and contiguous (kernels/bf16_gemv.c); written into ``out``
    ([N * K / 2] int32, contiguous) where given."""
    n, k = weight.shape
    w = weight.detach().contiguous()
    if out is None:
        out = torch.empty(n * k // 2, dtype=torch.int32)
    kernels.load("bf16_gemv").pack_pairs(w.data_ptr(), n, k, out.data_ptr())
    return out


def gemv_rows(x: torch.Tensor, pairs: torch.Tensor, n_out: int | None = None) -> torch.Tensor:
    """x: [M, K] bf16 (rows contiguous) -> [M, N] bf16, each row as oneDNN's GEMV gives it alone;
    ``pairs`` from ``pack`` ([N * K / 2] int32), ``n_out`` = N where the caller knows it.
    Raises MemoryError if the kernel's float32 scratch (2 * M * 64 values) cannot be allocated."""
    m, k = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    n = n_out if n_out is not None else pairs.numel() * 2 // k
    out = torch.empty(m, n, dtype=torch.bfloat16)
    if _rows_kernel()(x.data_ptr(), x.stride(0), m, k, pairs.data_ptr(), n, out.data_ptr()):
        raise MemoryError(f"bf16_gemv_rows: no scratch for {m} rows")
    return out


@functools.cache
def _rows_kernel():
    return kernels.load("bf16_gemv").bf16_gemv_rows  # looked up once: it runs for every linear layer of a step


def _probe_rows(k: int, rows: int, seed: int) -> torch.Tensor:
    """[rows, k] bf16 values whose float32 sums depend on the order: large and small mixed."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * torch.exp2(torch.randint(-6, 7, (rows, k), generator=g).float())
    return x.bfloat16()


def _gemv_needed_and_matched(linear: torch.nn.Linear) -> tuple[bool, bool]:
    x = _probe_rows(linear.in_features, 24, seed=linear.in_features)
    with torch.inference_mode():
        alone = torch.cat([linear(x[i : i + 1]) for i in range(len(x))])  # oneDNN GEMV, one row at a time
        batched = linear(x)  # oneDNN GEMM
        ours = gemv_rows(x, linear._gemv_pairs)
    return not torch.equal(alone, batched), torch.equal(alone, ours)


def prepare(model) -> int:
    """Give every bf16 linear layer whose GEMM rows differ from its GEMV a packed copy of its
    weight for ``gemv_rows`` (the model's ``forward``s must be fast_linear's); returns how many.
    Layers with a bias, an odd K or N not a multiple of 16 keep oneDNN."""
    if not available():
        return 0
    by_shape: dict[tuple[int, int], list[torch.nn.Linear]] = {}
    for module in model.modules():
        if (isinstance(module, torch.nn.Linear) and module.weight.dtype == torch.bfloat16 and module.bias is None
                and module.in_features % 2 == 0 and module.out_features % 16 == 0):
            by_shape.setdefault((module.in_features, module.out_features), []).append(module)
    taken: list[tuple[torch.nn.Linear, bool]] = []
    for shape, modules in by_shape.items():
        probe = modules[0]
        probe._gemv_pairs = pack(probe.weight)
        needed, matched = _gemv_needed_and_matched(probe)
        probe._gemv_pairs = None
        if not matched:
            if needed:
                log.warning("bf16 GEMV kernel does not reproduce oneDNN's for %s; batched decode rows keep oneDNN's GEMM", shape)
            continue
        taken += [(module, needed) for module in modules]  # bit-identical to oneDNN's GEMV, and it streams the weights faster
    # every layer's pairs in one huge-page arena (huge_pages.py): a decode step streams them all
    arena = huge_pages.zeros((sum(m.weight.numel() // 2 for m, _ in taken),), torch.int32)
    offset = 0
    for module, needed in taken:
        size = module.weight.numel() // 2
        module._gemv_pairs = pack(module.weight, arena[offset : offset + size])
        module._gemv_required = needed  # batched decode rows must take it; else only few rows do
        offset += size
    return len(taken)
