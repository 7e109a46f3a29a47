"""A router replica's drain before a shutdown (``pdserve down``).

``Drain.run(drain_s)``: from now on ``check()`` refuses new requests (ShuttingDownError:
UNAVAILABLE / HTTP 503 with a retry hint); requests in flight get up to ``drain_s`` seconds
to finish; then every stream still running ends with ShuttingDownError (``expired()``,
which each stream waits on beside its tokens: router/disconnect.py ``follow``), a final
error status (gRPC) or error event (HTTP), never a silent cut. Each stream's own clean-up
frees both pools as for a client that left.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable

from pdserve.errors import ShuttingDownError

POLL_S = 0.05  # how often the drain looks at the requests in flight
CLOSE_DEADLINE_S = 10.0  # after the deadline, the longest wait for the cut streams to end


class Drain:
    """``in_flight()``: requests this replica is serving now; ``retry_after_s``: the hint a
    refused request gets. Create it on the replica's event loop."""

    def __init__(self, in_flight: Callable[[], int], retry_after_s: float):
        self.in_flight, self.retry_after_s = in_flight, retry_after_s
        self.draining = False
        self._expired = asyncio.Event()

    def check(self) -> None:
        """Raises ShuttingDownError while draining."""
        if self.draining:
            raise ShuttingDownError(f"the server is shutting down and takes no new requests; retry after {self.retry_after_s:g} s "
                                    "(on another server, or this one once it is back)", self.retry_after_s)

    async def expired(self) -> ShuttingDownError:
        """Returns (never raises) the error that ends a stream, once the drain's deadline passes."""
        await self._expired.wait()
        return ShuttingDownError(f"the server shut down before this request finished (its drain deadline passed); "
                                 f"retry after {self.retry_after_s:g} s", self.retry_after_s)

    async def run(self, drain_s: float, clock: Callable[[], float] = time.monotonic) -> dict[str, int]:
        """Drain (see the module doc). Returns {"in_flight": at the start, "finished": of those,
        within ``drain_s``, "cut": ended by the deadline, "left": still in flight at the end
        (0 unless a stream outlived CLOSE_DEADLINE_S)}."""
        self.draining = True
        start_count, deadline = self.in_flight(), clock() + drain_s
        while self.in_flight() > 0 and clock() < deadline:
            await asyncio.sleep(POLL_S)
        cut = self.in_flight()
        if cut:
            self._expired.set()
            closing = clock() + CLOSE_DEADLINE_S
            while self.in_flight() > 0 and clock() < closing:
                await asyncio.sleep(POLL_S)
        return {"in_flight": start_count, "finished": max(0, start_count - cut), "cut": cut, "left": self.in_flight()}
