"""Hardware limits measured in the same run as the benchmarks, at the worker's thread count
(or on a CUDA device: HBM read bandwidth, device memcpy, tensor-core matmul)."""

from __future__ import annotations

import platform
import re
import time
from pathlib import Path

import torch

_ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")  # what the bf16 kernels use


def sync(device: str = "cpu") -> None:
    """Wait for queued GPU work (timings on a CUDA device end here); no-op on the CPU."""
    if str(device).startswith("cuda"):
        torch.cuda.synchronize(device)


def _best_of(fn, repeats: int, device: str = "cpu") -> float:
    fn()  # warm up
    sync(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def memory_read_bandwidth(num_bytes: int = 1 << 30, repeats: int = 5, device: str = "cpu") -> float:
    """Bytes/s of a streaming read (``sum`` over a ``num_bytes`` float32 tensor, far larger
    than cache). On a CPU the faster of torch's own memory and 2 MiB huge pages
    (engine/huge_pages.py, where the engine keeps its weights and KV): a core streams huge
    pages faster (AMD EPYC Zen 4: ~31 against ~25 GB/s), and the limit is the faster one."""
    x = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    best = num_bytes / _best_of(lambda: x.sum(), repeats, device)
    if device == "cpu":
        del x
        from pdserve.engine import huge_pages

        x = huge_pages.zeros(num_bytes // 4, torch.float32).fill_(1.0)
        best = max(best, num_bytes / _best_of(lambda: x.sum(), repeats, device))
    return best


def memcpy_bandwidth(num_bytes: int = 1 << 29, repeats: int = 5, device: str = "cpu") -> float:
    """Bytes/s copied (read + write counted once, as memcpy figures usually are)."""
    src = torch.ones(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return num_bytes / _best_of(lambda: dst.copy_(src), repeats, device)


def matmul_flops(dtype: torch.dtype, n: int = 2048, repeats: int = 5, device: str = "cpu") -> float:
    """FLOP/s of an n x n x n matmul (2 n^3 FLOPs) in ``dtype`` (n = 8192 on a GPU, to fill it)."""
    n = 8192 if str(device).startswith("cuda") else n
    a, b = torch.randn(n, n, device=device).to(dtype), torch.randn(n, n, device=device).to(dtype)
    return 2 * n**3 / _best_of(lambda: a @ b, repeats, device)


def fma_instruction_peak(dtype: str = "bfloat16", repeats: int = 5) -> float | None:
    """FLOP/s of one thread issuing only the linear kernel's FMA instruction (24 independent
    chains, pdserve/engine/cpu/linear.c ``fma_peak_probe``): TDPBF16PS tile products for bf16
    where the kernels run on AMX, VDPBF16PS for bf16 on AVX512-BF16, else the float32 vector FMA. The most one core can do in the step's matmuls;
    None without a C compiler."""
    from pdserve.engine import cpu

    lib = cpu.load("linear")
    if lib is None:
        return None
    bf = int(dtype == "bfloat16")
    iters = 1_000_000
    return iters * 24 * lib.fma_flops_per_instruction(bf) / _best_of(lambda: lib.fma_peak_probe(iters, bf), repeats)


def describe(device: str = "cpu") -> dict[str, str]:
    """Which machine the figures come from: CPU model and its vector instruction sets (from
    /proc/cpuinfo), or the GPU's name; torch's version. Ratios move with these: an AVX2-only
    CPU, say, has no bf16 dot-product instruction and converts bf16 to float32 for every FMA."""
    info = {"torch": torch.__version__, "cpu": platform.processor() or platform.machine(), "cpu_flags": ""}
    try:
        text = Path("/proc/cpuinfo").read_text()
        info["cpu"] = re.search(r"^model name\s*:\s*(.*)$", text, re.M).group(1)
        flags = set(re.search(r"^flags\s*:\s*(.*)$", text, re.M).group(1).split())
        info["cpu_flags"] = " ".join(f for f in _ISA_FLAGS if f in flags)
    except (OSError, AttributeError):
        pass
    if str(device).startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def measure(device: str = "cpu") -> dict:
    """The limits (bytes/s, FLOP/s) at torch's current thread count, with ``describe``'s fields."""
    return {
        **describe(device),
        "device": str(device),
        "num_threads": torch.get_num_threads(),
        "mem_read_bytes_per_s": memory_read_bandwidth(device=device),
        "memcpy_bytes_per_s": memcpy_bandwidth(device=device),
        "matmul_fp32_flops": matmul_flops(torch.float32, device=device),
        "matmul_bf16_flops": matmul_flops(torch.bfloat16, device=device),
        "bf16_instruction_peak_flops": None if str(device).startswith("cuda") else fma_instruction_peak("bfloat16"),
        "f32_instruction_peak_flops": None if str(device).startswith("cuda") else fma_instruction_peak("float32"),
    }
