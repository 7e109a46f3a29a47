"""Fault injection on the sender side, for tests of the transfer fault policy.

``FaultInjector.arm(kind, count)`` makes the next ``count`` transfers fail in one way:

- ``timeout``: the sender stalls ``stall_s`` seconds before answering a fetch;
- ``break``: the stream (or the shm description) is aborted with UNAVAILABLE mid-way;
- ``corrupt``: one payload byte (grpc) or one layer checksum (shm) is wrong;
- ``expire``: the lease is put already expired, as if decode came too late.

In-process tests arm a sender's injector directly. A deployed replica is armed from
outside (``bench/soak.py``) through a directory named by ``PDSERVE_FAULT_KV_DIR`` in its
environment: a file named after a kind, put there, is claimed (renamed) by the first sender
to look, which arms that kind once. A sender looks at most every ``POLL_S`` seconds, and
only where the variable is set.

Nothing is armed in normal operation; each check is one dict lookup.
"""

from __future__ import annotations

import os
import threading
import time

KINDS = ("timeout", "break", "corrupt", "expire")
ARM_DIR_ENV = "PDSERVE_FAULT_KV_DIR"
POLL_S = 0.2


class FaultInjector:
    """``stall_s``: how long a "timeout" stalls. ``arm_dir``: the directory to take armed
    faults from (the module doc), by default ``$PDSERVE_FAULT_KV_DIR``; None: none."""

    def __init__(self, stall_s: float = 5.0, arm_dir: str | None = None):
        self.stall_s = stall_s
        self.arm_dir = arm_dir if arm_dir is not None else os.environ.get(ARM_DIR_ENV)
        self._next_poll = 0.0
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
        if self.arm_dir is not None:
            self._poll()
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

    def _poll(self) -> None:
        """Arm the kinds whose files wait in ``arm_dir``, claiming each by a rename (so one
        sender of the pool takes it)."""
        now = time.monotonic()
        if now < self._next_poll:
            return
        self._next_poll = now + POLL_S
        try:
            names = os.listdir(self.arm_dir)
        except OSError:
            return
        for kind in KINDS:
            if kind in names:
                try:
                    os.rename(os.path.join(self.arm_dir, kind), os.path.join(self.arm_dir, f"{kind}.taken-{os.getpid()}-{now:.3f}"))
                except OSError:
                    continue  # another sender claimed it first
                self.arm(kind)
