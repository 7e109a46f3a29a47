"""Errors shared by the router and both worker pools.

Each maps to one gRPC status code in the router (router/errors.py).
"""


class PDServeError(Exception):
    """Base class of pdserve's request errors."""


class InvalidRequestError(PDServeError, ValueError):
    """The request itself is wrong (maps to INVALID_ARGUMENT / HTTP 400)."""


class KVTransferError(PDServeError):
    """The prompt's KV could not be fetched: missing, expired, corrupt or timed out."""


class KVNotFoundError(KVTransferError):
    """The prefill side holds no KV under that transfer id (released or lease expired)."""


class KVIncompatibleError(KVTransferError):
    """The prefill worker's KV fingerprint differs from the decode worker's; ``field`` names what."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


class PrefillEndedError(KVTransferError):
    """A layer-wise transfer ended because prefill finished the request at its first token
    (a stop token, or max_tokens 1): there is nothing to decode. Not a fault."""


class FirstTokenMissingError(KVTransferError):
    """A layer-wise KV stream broke before prefill's first token arrived, so the decode
    worker cannot recompute in its place; the router resends the request with the token."""


class KVAuthError(KVTransferError):
    """The prefill worker refused the KV channel's shared secret: the pools were deployed
    with different ``security.kv_secret`` (a deployment error, like KVIncompatibleError)."""


class CapacityError(PDServeError):
    """No room right now (too many requests in flight, a pool's queue or KV pool full);
    retry after ``retry_after_s`` seconds (maps to RESOURCE_EXHAUSTED / HTTP 429 with a
    ``retry-after`` hint)."""

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ShuttingDownError(PDServeError):
    """The router is draining before a shutdown (``pdserve down``): a new request is refused
    (retry on another server, or once it is back, after ``retry_after_s`` seconds), and a
    stream still running at the drain's deadline ends with it. Maps to UNAVAILABLE / HTTP 503
    with a ``retry-after`` hint."""

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class WorkerStalledError(PDServeError, RuntimeError):
    """A worker's engine step has run longer than its pool's ``max_step_s`` (a hung
    forward). The replica fails its health check and is replaced; the router treats the
    error as a lost replica (prefill: sent again; decode: migrated)."""


class AuthenticationError(PDServeError):
    """No API key, or the wrong one (maps to UNAUTHENTICATED / HTTP 401)."""


class RequestTooLargeError(InvalidRequestError):
    """The request's bytes exceed router.max_request_bytes (INVALID_ARGUMENT / HTTP 413)."""
