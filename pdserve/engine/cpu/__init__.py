"""pdserve's CPU kernels in C, compiled on first use and loaded through ctypes.

- ``linear.c``: batch-invariant linear layers, float32 and bf16 (ops.py ``linear``), over
  dense weights or GGUF quantized ones (``linear_q.h``, ops.py ``qlinear``).
- ``pointwise.c``: fused residual add + RMSNorm, rotary in place, SiLU * mul.
- ``attention.c``: paged causal attention over the KV pool, prompt chunks and decode alike.
- ``decoder.c``: a step's decoder layers in one call over the three above (ops.py ``Decoder``).
- ``kv_blocks.c``: block copies and checksums for the shm KV transfer backend.
- ``tp_comm.c``: tensor parallelism's all-reduce and barrier over one shared-memory segment.
- ``simd.h``, ``parallel.h``: the vector abstraction (AVX-512, AVX2, portable) and the thread
  split (one pool of workers, the linear library's, shared by every library that splits work).
- ``amx.h``, ``linear_amx.h``, ``attention_amx.h``: bf16 linear layers and attention on AMX
  tiles (Intel Sapphire Rapids and later), where the compiler targets AMX and Linux grants
  the tile state; ``PDSERVE_NO_AMX=1`` keeps the AVX512-BF16 paths.
- ``attention_dp.h``: bf16 attention on AVX512-BF16 dot products (``vdpbf16ps``), where there
  is no AMX (AMD Zen 4 and later).

Each is built with the system C compiler (``cc -O3 -march=native -ffp-contract=off``) into
``~/.cache/pdserve/kernels/`` (``$PDSERVE_CACHE/kernels`` where set, as the model cache),
keyed by a hash of the source, the headers here, the compiler and this CPU's flags, under a
file lock so concurrent workers build it once. No torch headers are involved: a build takes
about a second. Where no compiler is found or the build fails, ``load()`` returns None and
callers fall back (a warning says why; ``problem()`` gives it, with the compiler's message).
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
import threading
from pathlib import Path

logger = logging.getLogger(__name__)

_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-shared", "-fPIC", "-std=gnu11"]
_i64, _u64, _ptr = ctypes.c_int64, ctypes.c_uint64, ctypes.c_void_p
_f = ctypes.c_float
_SIGNATURES = {  # name -> {function: (restype, argtypes)}
    "linear": {
        "linear_f32": (None, [_ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _ptr, _i64, _i64]),
        "linear_bf16": (None, [_ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _ptr, _i64, _i64]),
        "linear_silu_bf16": (ctypes.c_int, [_ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _ptr, _i64, _i64]),
        "linear_pack_f32": (None, [_ptr, _i64, _i64, _i64, _ptr]),
        "linear_pack_bf16": (None, [_ptr, _i64, _i64, _i64, _ptr]),
        "linear_packed_numel": (_i64, [_i64, _i64, ctypes.c_int]),
        "fma_peak_probe": (_f, [_i64, ctypes.c_int]),
        "fma_flops_per_instruction": (_i64, [ctypes.c_int]),
        "linear_isa": (ctypes.c_char_p, [ctypes.c_int]),
        "qlinear_packed_bytes": (_i64, [_i64, _i64, _i64]),
        "qlinear_pack": (ctypes.c_int, [_i64, _ptr, _i64, _i64, _ptr]),
        "qlinear_dequant": (None, [_ptr, _ptr]),
        "qlinear_f32": (None, [_ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _ptr, _i64, _i64]),
        "qlinear_bf16": (None, [_ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _ptr, _i64, _i64]),
    },
    "pointwise": {
        "add_rmsnorm": (None, [_ptr, _i64, _ptr, _i64, ctypes.c_int, _ptr, _ptr, _i64, _i64, _i64, _f, ctypes.c_int, _i64]),
        "rope_inplace": (None, [_ptr, _i64, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, ctypes.c_int, _i64]),
        "silu_mul": (None, [_ptr, _i64, _ptr, _i64, _i64, _i64, ctypes.c_int, _i64]),
        "mask_logits": (None, [_ptr, _i64, _ptr, ctypes.c_int]),
    },
    "attention": {
        "paged_attention": (ctypes.c_int, [_ptr, _i64, _i64, _i64, _i64, _i64, _ptr, _ptr, _i64, _ptr, _ptr, _i64, _ptr, _ptr, _i64,
                                           _ptr, _ptr, _i64, _f, _ptr, ctypes.c_int, _i64]),
        "paged_attention_windowed": (ctypes.c_int, [_ptr, _i64, _i64, _i64, _i64, _i64, _ptr, _ptr, _i64, _ptr, _ptr, _i64, _ptr, _ptr,
                                                    _i64, _ptr, _ptr, _i64, _f, _ptr, ctypes.c_int, _i64, _i64, _f]),
    },
    "decoder": {
        "decoder_layers": (ctypes.c_int, [_ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _i64]),
    },
    "tp_comm": {
        "tp_barrier": (ctypes.c_int, [_ptr, ctypes.c_int, ctypes.c_int, _u64, ctypes.c_double]),
        "tp_allreduce": (ctypes.c_int, [_ptr, ctypes.c_int, ctypes.c_int, _i64, _u64, _ptr, _i64, ctypes.c_int, ctypes.c_double]),
        "tp_slot": (_ptr, [_ptr, ctypes.c_int, _i64, _u64, ctypes.c_int]),
        "tp_ctx_allreduce": (ctypes.c_int, [_ptr, _ptr, _i64]),
        "tp_abort": (None, [_ptr]),
    },
    "kv_blocks": {
        "kv_checksum_blocks": (_u64, [_ptr, _i64, _i64, _ptr, _i64, _i64, _u64]),
        "kv_copy_blocks_checksum": (_u64, [_ptr, _i64, _ptr, _i64, _i64, _ptr, _ptr, _i64, _i64, _u64]),
    },
}
_libs: dict[str, ctypes.CDLL | None] = {}
_problems: dict[str, str] = {}  # name -> why it did not load
_load_lock = threading.RLock()


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
            subprocess.run([compiler, *_FLAGS, "-o", str(tmp), str(source), "-lm", "-lpthread"], check=True, capture_output=True, timeout=120)
            tmp.rename(target)
    return target


def compiler() -> str | None:
    """The C compiler kernels are built with: ``$CC``, else ``cc`` or ``gcc`` on the PATH; None if none."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def problem(name: str) -> str | None:
    """Why library ``name`` did not load (no compiler, or the build's error with the compiler's
    message), None if it loaded. Tries the build first where it has not been tried."""
    load(name)
    return _problems.get(name)


def load(name: str) -> ctypes.CDLL | None:
    """The compiled library ``name`` (a .c file here), or None where it cannot be built (logged
    once; ``problem(name)`` says why)."""
    if name in _libs:  # set only once loading ended (the per-call path: no lock)
        return _libs[name]
    with _load_lock:  # one build per process: a thread that comes during it waits for its result
        if name not in _libs:
            _libs[name] = _load(name)
    return _libs[name]


def _load(name: str) -> ctypes.CDLL | None:
    cc = compiler()
    if cc is None:
        _problems[name] = "no C compiler found (cc, gcc or $CC)"
        logger.warning("pdserve: no C compiler found; %s kernels are unavailable, using the slower fallback", name)
        return None
    try:
        lib = ctypes.CDLL(str(_build(cc, name)))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = (getattr(exc, "stderr", b"") or b"").decode(errors="replace")
        _problems[name] = f"building {name}.c with {cc} failed: {exc}\n{detail}"
        logger.warning("pdserve: building %s.c failed (%s %s); using the slower fallback", name, exc, detail[:500])
        return None
    for fn_name, (restype, argtypes) in _SIGNATURES[name].items():
        fn = getattr(lib, fn_name)
        fn.restype, fn.argtypes = restype, argtypes
    if name != "linear" and hasattr(lib, "parallel_use"):  # one pool of workers for every kernel (parallel.h)
        owner = load("linear")
        if owner is not None:
            lib.parallel_use.restype, lib.parallel_use.argtypes = None, [_ptr]
            lib.parallel_use(ctypes.cast(owner.parallel_run, _ptr).value)
    return lib


def has_bf16_instructions() -> bool:
    """Whether this CPU has bf16 dot-product instructions (AVX512-BF16 or AMX-BF16): there
    bf16 runs natively and ``dtype: auto`` picks it. Elsewhere the kernels widen bf16 weights
    to float32 in registers (linear.c)."""
    flags = _cpu_flags().split()
    return "avx512_bf16" in flags or "amx_bf16" in flags
