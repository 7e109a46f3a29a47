"""Map pdserve's errors to gRPC status codes."""

from __future__ import annotations

import grpc

from pdserve.errors import CapacityError, InvalidRequestError, KVIncompatibleError, KVTransferError


def grpc_status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """(status code, message) for an exception raised on the request path.

    Ray re-raises a worker's exception as a RayTaskError that is also an
    instance of the original class, so isinstance works across the hop.
    """
    if isinstance(exc, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT, _message(exc)
    if isinstance(exc, CapacityError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, _message(exc)
    if isinstance(exc, KVIncompatibleError):  # a deployment error: the pools run different models
        return grpc.StatusCode.FAILED_PRECONDITION, _message(exc)
    if isinstance(exc, KVTransferError):
        return grpc.StatusCode.UNAVAILABLE, f"KV transfer failed: {_message(exc)}"
    if isinstance(exc, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, _message(exc) or "deadline exceeded"
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {_message(exc)}"


def _message(exc: BaseException) -> str:
    cause = getattr(exc, "cause", None)  # RayTaskError keeps the original here
    return str(cause if cause is not None else exc).strip()
