"""Hardware limits measured in the same run as the benchmarks, at the worker's thread count."""

from __future__ import annotations

import time

import torch


def _best_of(fn, repeats: int) -> float:
    fn()  # warm up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def memory_read_bandwidth(num_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes/s of a streaming read (``sum`` over a ``num_bytes`` float32 tensor, far larger than cache)."""
    x = torch.ones(num_bytes // 4, dtype=torch.float32)
    return num_bytes / _best_of(lambda: x.sum(), repeats)


def memcpy_bandwidth(num_bytes: int = 1 << 29, repeats: int = 5) -> float:
    """Bytes/s copied (read + write counted once, as memcpy figures usually are)."""
    src = torch.ones(num_bytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    return num_bytes / _best_of(lambda: dst.copy_(src), repeats)


def matmul_flops(dtype: torch.dtype, n: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of an n x n x n matmul (2 n^3 FLOPs) in ``dtype``."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    return 2 * n**3 / _best_of(lambda: a @ b, repeats)


def measure() -> dict[str, float]:
    return {
        "num_threads": torch.get_num_threads(),
        "mem_read_bytes_per_s": memory_read_bandwidth(),
        "memcpy_bytes_per_s": memcpy_bandwidth(),
        "matmul_fp32_flops": matmul_flops(torch.float32),
        "matmul_bf16_flops": matmul_flops(torch.bfloat16),
    }
