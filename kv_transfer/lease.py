"""LeaseTable: the prefill side's store of prompt KV awaiting pickup.

Each entry (a ``kv_transfer.base.KVSource``, or anything with its ``release()`` and ``nbytes``) is freed, through its ``release``, by ``release`` (decode acknowledged, or a cancel) or when
its lease runs out; a daemon thread reaps expired entries every ``reap_interval_s``.

A release can overtake its hold: the router gives up on a request (its client left) while
the prefill reply is on its way, and Ray Serve cancels the call, so the router never sees
the handle and releases by request id. Such an id is remembered for ``early_release_s``, and
a hold that comes for it frees the KV at once instead of leaving it to expire.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar


class HeldKV(Protocol):
    """What the table needs of a held entry (``kv_transfer.base.KVSource`` has both)."""

    @property
    def nbytes(self) -> int: ...

    def release(self) -> None: ...


S = TypeVar("S", bound=HeldKV)

log = logging.getLogger(__name__)
MAX_EARLY_RELEASES = 10_000  # ids remembered at once; the oldest are forgotten first


@dataclass
class _Lease(Generic[S]):
    source: S
    expires_at: float  # time.monotonic() seconds


class LeaseTable(Generic[S]):
    def __init__(self, reap_interval_s: float = 0.5, early_release_s: float = 120.0):
        self._leases: dict[str, _Lease] = {}
        self._released_early: dict[str, float] = {}  # transfer_id -> time.monotonic() until which a hold for it is freed at once
        self._early_release_s = early_release_s
        self._lock = threading.Lock()
        self.num_released = 0
        self.num_expired = 0
        self._finished: deque[tuple[str, str]] = deque(maxlen=100_000)  # (transfer_id, "released" | "expired"), not yet popped
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap_loop, args=(reap_interval_s,), daemon=True, name="kv-lease-reaper")
        self._reaper.start()

    def hold(self, transfer_id: str, source: S, lease_s: float) -> None:
        """Hold ``source`` for ``lease_s`` seconds; if the id was released before (see the
        module's docstring), free it now instead, counted as released. Raises KeyError if the
        id is already held."""
        with self._lock:
            if transfer_id in self._leases:
                raise KeyError(f"transfer id {transfer_id!r} is already held")
            released_early = self._released_early.pop(transfer_id, 0.0) > time.monotonic()
            if not released_early:
                self._leases[transfer_id] = _Lease(source, time.monotonic() + lease_s)
                return
            self.num_released += 1
            self._finished.append((transfer_id, "released"))
        source.release()

    def renew(self, transfer_id: str, lease_s: float) -> bool:
        """Restart a held lease's clock at ``lease_s`` seconds from now; False if it is gone."""
        with self._lock:
            lease = self._leases.get(transfer_id)
            if lease is None:
                return False
            lease.expires_at = time.monotonic() + lease_s
            return True

    def get(self, transfer_id: str) -> S | None:
        """The held KV, or None if unknown, released or expired."""
        with self._lock:
            lease = self._leases.get(transfer_id)
            if lease is None or lease.expires_at <= time.monotonic():
                return None
            return lease.source

    def release(self, transfer_id: str) -> bool:
        """Free a held lease now; False if it is not held (then a later hold of the id is
        freed at once, for ``early_release_s``)."""
        with self._lock:
            lease = self._leases.pop(transfer_id, None)
            if lease is None:
                self._remember_early_release(transfer_id)
                return False
            self.num_released += 1
            self._finished.append((transfer_id, "released"))
        lease.source.release()
        return True

    def _remember_early_release(self, transfer_id: str) -> None:
        now = time.monotonic()
        while self._released_early and (len(self._released_early) >= MAX_EARLY_RELEASES
                                        or next(iter(self._released_early.values())) <= now):
            del self._released_early[next(iter(self._released_early))]  # oldest first (insertion order)
        self._released_early[transfer_id] = now + self._early_release_s

    def reap(self) -> int:
        """Drop every expired lease; returns how many."""
        now = time.monotonic()
        with self._lock:
            expired = [tid for tid, lease in self._leases.items() if lease.expires_at <= now]
            sources = [self._leases.pop(tid).source for tid in expired]
            self.num_expired += len(expired)
            self._finished.extend((tid, "expired") for tid in expired)
        if expired:
            log.warning("KV lease expired unfetched, freed: %s", ", ".join(expired))
        for source in sources:
            source.release()
        return len(expired)

    def pop_finished(self) -> list[tuple[str, str]]:
        with self._lock:
            finished = list(self._finished)
            self._finished.clear()
        return finished

    def _reap_loop(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            self.reap()

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "num_held": len(self._leases),
                "bytes_held": sum(lease.source.nbytes for lease in self._leases.values()),
                "num_released": self.num_released,
                "num_expired": self.num_expired,
            }

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            sources = [lease.source for lease in self._leases.values()]
            self._leases.clear()
        for source in sources:
            source.release()
