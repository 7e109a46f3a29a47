"""Admission control and authentication of one router replica: the checks a request
passes before it costs the pools anything."""

from __future__ import annotations

import hmac
import time
from collections import deque
from typing import Callable, Iterable

from pdserve.errors import AuthenticationError, CapacityError, RequestTooLargeError

QUEUE_WINDOW_S = 2.0  # requests that reached decode this many seconds back tell whether a queue stands


class QueueWatch:
    """Whether requests queue before they decode, as CoDel tells a standing queue (Nichols &
    Jacobson, "Controlling Queue Delay", ACM Queue 10(5), 2012): by the *least* delay of the
    last ``QUEUE_WINDOW_S`` seconds, which one long prompt cannot raise, while a queue that
    every request waits in raises it for all.

    The delay is a request's time from admission to its first token from decode (its second
    token, as prefill samples the first; or its end, if that comes first): it spans both
    pools' queues (the prefill pool's, and Ray Serve's queue of calls to a decode replica
    that runs ``max_ongoing_requests``), the prefill, the KV hand-off and one decode step.

    ``queue_s()``: 0 when no admitted request is still waiting to decode (a new one joins
    no queue: neither a lone late request that ends a burst nor a burst that has fully
    drained holds the door shut); else the least such delay among the requests that
    reached decode in the window, if at least two did; else how long the oldest request
    still waiting has waited. Times in seconds, from ``clock``."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._waiting: dict[str, float] = {}  # request id -> admitted at, oldest first
        self._firsts: deque[tuple[float, float]] = deque()  # (at, time to first token), oldest first

    def started(self, request_id: str) -> None:
        self._waiting[request_id] = self.clock()

    def decoding(self, request_id: str) -> None:
        """The request's first token from decode came (or it ended before)."""
        started = self._waiting.pop(request_id, None)
        if started is not None:
            now = self.clock()
            self._firsts.append((now, now - started))

    def ended(self, request_id: str) -> None:
        self._waiting.pop(request_id, None)

    def queue_s(self) -> float:
        now = self.clock()
        while self._firsts and self._firsts[0][0] < now - QUEUE_WINDOW_S:
            self._firsts.popleft()
        if not self._waiting:
            return 0.0
        if len(self._firsts) >= 2:
            return min(ttft for _, ttft in self._firsts)
        return now - next(iter(self._waiting.values()))


class Admission:
    """Admission control of one router replica (gRPC and HTTP together). A request is
    refused with CapacityError (RESOURCE_EXHAUSTED / HTTP 429, ``retry_after_s`` as its hint),
    at once, when ``max_in_flight`` requests are in flight, or when a new request would queue
    longer than ``max_queue_s`` before it decodes (None = never): an overloaded router refuses
    new work rather than hold it for longer than that. The wait is the larger of the standing
    queue (QueueWatch) and ``expected_wait_s()``, the caller's estimate of the queue it is
    about to join (the router's: the prefill pool's, router/placement.py), which sees a
    burst before any request of it has reached decode."""

    def __init__(self, max_in_flight: int, retry_after_s: float, max_request_bytes: int, api_key: str | None,
                 max_queue_s: float | None = None, expected_wait_s: Callable[[], float] = lambda: 0.0,
                 clock: Callable[[], float] = time.monotonic):
        self.max_in_flight, self.retry_after_s, self.max_request_bytes = max_in_flight, retry_after_s, max_request_bytes
        self.max_queue_s, self.expected_wait_s = max_queue_s, expected_wait_s
        self.queue = QueueWatch(clock)
        self._api_key = api_key.encode() if api_key else None
        self.num_in_flight = 0
        self.num_refused = 0
        self.num_refused_queue = 0  # of num_refused: for the queue before decode

    def admit(self, request_id: str = "") -> None:
        """Take a place; pair with ``release(request_id)``, and tell ``decoding(request_id)``.
        Raises CapacityError when full or queued past ``max_queue_s``."""
        if self.num_in_flight >= self.max_in_flight:
            self.num_refused += 1
            raise CapacityError(f"server busy: {self.num_in_flight} requests in flight (router.max_in_flight); "
                                f"retry after {self.retry_after_s:g} s", self.retry_after_s)
        if self.max_queue_s is not None and (queued := max(self.queue.queue_s(), self.expected_wait_s())) > self.max_queue_s:
            self.num_refused += 1
            self.num_refused_queue += 1
            raise CapacityError(f"server busy: a request would wait about {queued:.1f} s to start decoding, more than "
                                f"router.max_queue_s ({self.max_queue_s:g} s); retry after {self.retry_after_s:g} s", self.retry_after_s)
        self.num_in_flight += 1
        self.queue.started(request_id)

    def decoding(self, request_id: str = "") -> None:
        self.queue.decoding(request_id)

    def release(self, request_id: str = "") -> None:
        self.num_in_flight -= 1
        self.queue.ended(request_id)

    def check_size(self, num_bytes: int) -> None:
        """Raises RequestTooLargeError above router.max_request_bytes."""
        if num_bytes > self.max_request_bytes:
            raise RequestTooLargeError(f"request is {num_bytes} bytes, more than router.max_request_bytes ({self.max_request_bytes})")

    def authenticate(self, authorization: str | None) -> None:
        """``authorization``: the "Bearer <key>" header or metadata value. Raises
        AuthenticationError when an API key is set and this is not it."""
        if self._api_key is None:
            return
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self._api_key):
            raise AuthenticationError("missing or wrong API key: send \"authorization: Bearer <key>\" (security.api_key)")

    def stats(self) -> dict[str, int]:
        return {"num_in_flight": self.num_in_flight, "num_refused": self.num_refused, "num_refused_queue": self.num_refused_queue}


def metadata_value(metadata: Iterable[tuple[str, str]] | None, key: str) -> str | None:
    return next((v for k, v in metadata or () if k.lower() == key), None)
