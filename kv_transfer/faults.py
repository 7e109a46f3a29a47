"""Fault injection on the sender side, for tests of the transfer fault policy.

``FaultInjector.arm(kind, count)`` makes the next ``count`` transfers fail in one way:

- ``timeout``: the sender stalls ``stall_s`` seconds before answering a fetch;
- ``break``: the stream (or the shm description) is aborted with UNAVAILABLE mid-way;
- ``corrupt``: one payload byte (grpc) or one layer checksum (shm) is wrong;
- ``expire``: the lease is put already expired, as if decode came too late.

Nothing is armed in normal operation; each check is one dict lookup.
"""

from __future__ import annotations

import threading

KINDS = ("timeout", "break", "corrupt", "expire")


class FaultInjector:
    def __init__(self, stall_s: float = 5.0):
        self.stall_s = stall_s
        self._armed: dict[str, int] = {}
        self._lock = threading.Lock()

    def arm(self, kind: str, count: int = 1) -> None:
        """Raises ValueError for an unknown kind."""
        if kind not in KINDS:
            raise ValueError(f"unknown fault {kind!r}; one of {KINDS}")
        with self._lock:
            self._armed[kind] = self._armed.get(kind, 0) + count

    def take(self, kind: str) -> bool:
        """True (once per armed count) if this transfer should suffer ``kind``."""
        if not self._armed:
            return False
        with self._lock:
            left = self._armed.get(kind, 0)
            if left <= 0:
                return False
            if left == 1:
                del self._armed[kind]
            else:
                self._armed[kind] = left - 1
            return True
