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


class CapacityError(PDServeError):
    """No room right now (KV pool full); retry later (maps to RESOURCE_EXHAUSTED)."""
