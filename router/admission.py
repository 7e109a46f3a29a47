"""Admission control and authentication of one router replica: the checks a request
passes before it costs the pools anything."""

from __future__ import annotations

import hmac
from typing import Iterable

from pdserve.errors import AuthenticationError, CapacityError, RequestTooLargeError


class Admission:
    """At most ``max_in_flight`` requests at once (gRPC and HTTP together); the next one
    gets CapacityError (RESOURCE_EXHAUSTED / HTTP 429) with ``retry_after_s`` as its hint,
    at once: an overloaded router refuses, it never queues without bound."""

    def __init__(self, max_in_flight: int, retry_after_s: float, max_request_bytes: int, api_key: str | None):
        self.max_in_flight, self.retry_after_s, self.max_request_bytes = max_in_flight, retry_after_s, max_request_bytes
        self._api_key = api_key.encode() if api_key else None
        self.num_in_flight = 0
        self.num_refused = 0

    def admit(self) -> None:
        """Take a place; pair with ``release()``. Raises CapacityError when full."""
        if self.num_in_flight >= self.max_in_flight:
            self.num_refused += 1
            raise CapacityError(f"server busy: {self.num_in_flight} requests in flight (router.max_in_flight); "
                                f"retry after {self.retry_after_s:g} s", self.retry_after_s)
        self.num_in_flight += 1

    def release(self) -> None:
        self.num_in_flight -= 1

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
        return {"num_in_flight": self.num_in_flight, "num_refused": self.num_refused}


def metadata_value(metadata: Iterable[tuple[str, str]] | None, key: str) -> str | None:
    return next((v for k, v in metadata or () if k.lower() == key), None)
