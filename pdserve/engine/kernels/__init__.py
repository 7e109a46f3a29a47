"""pdserve's CPU kernels in C, compiled on first use and loaded through ctypes.

- ``paged_attention.c``: decode attention over KV blocks in place (engine/paged_decode.py).
- ``kv_blocks.c``: block copies and checksums for the shm KV transfer backend.
- ``bf16_gemv.c``: batched bf16 GEMVs summed as oneDNN sums one row (engine/exact_gemv.py).
- ``prefill_attention.c``: causal prompt attention in bf16 as torch rounds it (engine/paged_prefill.py).
- ``torch_numerics.h``: torch's bf16 rounding and fexp_u20, shared by the attention kernels.

Each is built with the system C compiler (``cc -O3 -march=native``) into
``~/.cache/pdserve/kernels/`` (``$PDSERVE_CACHE/kernels`` where set, as the model cache),
keyed by a hash of the source, the headers here, the compiler and this CPU's flags, under a
file lock so concurrent workers build it once. No torch headers are involved: a build takes about a second. Where no compiler
is found or the build fails, ``load()`` returns None and callers fall back (a warning
says why).
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
from pathlib import Path

logger = logging.getLogger(__name__)

_FLAGS = ["-O3", "-march=native", "-shared", "-fPIC", "-std=c11"]
_i64, _u64, _ptr = ctypes.c_int64, ctypes.c_uint64, ctypes.c_void_p
_SIGNATURES = {  # name -> {function: (restype, argtypes)}
    "paged_attention": {
        name: (None, [_ptr, _i64, _i64, _ptr, _ptr, _i64, _ptr, _i64, _ptr, _i64, _i64, _i64, _i64, _i64, ctypes.c_float, _i64, _ptr, _ptr])
        for name in ("paged_decode_attention_bf16", "paged_decode_attention_f32")
    },
    "bf16_gemv": {
        "bf16_gemv_available": (ctypes.c_int, []),
        "pack_pairs": (None, [_ptr, _i64, _i64, _ptr]),
        "bf16_gemv_rows": (ctypes.c_int, [_ptr, _i64, _i64, _i64, _ptr, _i64, _ptr]),
        "bf16_dot_peak_probe": (ctypes.c_float, [_i64]),
    },
    "prefill_attention": {
        "prefill_attention_available": (ctypes.c_int, []),
        "prefill_attention_bf16": (ctypes.c_int, [_ptr, _i64, _i64, _ptr, _ptr, _i64, _ptr, _i64, _i64, _i64, _i64, _i64, _i64,
                                                  ctypes.c_float, _i64, _i64, _i64, ctypes.c_int, _ptr, _ptr]),
        "prefill_attention_scratch_bytes": (_i64, [_i64, _i64, _i64]),
    },
    "kv_blocks": {
        "kv_checksum_blocks": (_u64, [_ptr, _i64, _i64, _ptr, _i64, _i64, _u64]),
        "kv_copy_blocks_checksum": (_u64, [_ptr, _i64, _ptr, _i64, _i64, _ptr, _ptr, _i64, _i64, _u64]),
    },
}
_libs: dict[str, ctypes.CDLL | None] = {}


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _build(compiler: str, name: str) -> Path:
    source = Path(__file__).with_name(f"{name}.c")
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
    key = hashlib.sha256(source.read_bytes() + headers + " ".join([compiler, *_FLAGS, _cpu_flags()]).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("PDSERVE_CACHE") or os.environ.get("PDSERVE_CACHE_DIR") or Path.home() / ".cache" / "pdserve") / "kernels"
    cache.mkdir(parents=True, exist_ok=True)
    target = cache / f"{name}-{key}.so"
    with open(cache / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.exists():
            tmp = target.with_suffix(f".{os.getpid()}.tmp")
            subprocess.run([compiler, *_FLAGS, "-o", str(tmp), str(source), "-lm"], check=True, capture_output=True, timeout=120)
            tmp.rename(target)
    return target


def load(name: str = "paged_attention") -> ctypes.CDLL | None:
    """The compiled library ``name`` (a .c file here), or None where it cannot be built (logged once)."""
    if name in _libs:
        return _libs[name]
    _libs[name] = None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.warning("pdserve: no C compiler found; %s kernels are unavailable, using the slower fallback", name)
        return None
    try:
        lib = ctypes.CDLL(str(_build(compiler, name)))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        logger.warning("pdserve: building %s.c failed (%s %s); using the slower fallback", name, exc, detail.decode(errors="replace")[:500])
        return None
    for fn_name, (restype, argtypes) in _SIGNATURES[name].items():
        fn = getattr(lib, fn_name)
        fn.restype, fn.argtypes = restype, argtypes
    _libs[name] = lib
    return lib
