"""Keep large allocations on glibc's heap, so KV chunk buffers are reused, not re-faulted.

glibc serves allocations above M_MMAP_THRESHOLD (128 KiB, adapting upward) with a fresh
mmap and unmaps them on free, so every multi-MB KV chunk would page-fault its way in
(measured here: encoding 47 MB of KV ran at 0.9 GB/s that way, 3.6 GB/s with this set).
Raising the mmap and trim thresholds keeps freed chunks for reuse. Process-wide, done
once, and only where the C library is glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
_done = False


def keep_large_allocations(mmap_threshold: int = 256 << 20, trim_threshold: int = 1 << 30) -> bool:
    """True if glibc took the settings (bytes)."""
    global _done
    if _done:
        return True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        _done = bool(libc.mallopt(M_MMAP_THRESHOLD, mmap_threshold)) and bool(libc.mallopt(M_TRIM_THRESHOLD, trim_threshold))
    except (OSError, AttributeError):
        _done = False
    return _done
