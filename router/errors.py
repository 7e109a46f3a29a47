"""Map pdserve's errors to gRPC status codes."""

from __future__ import annotations

import grpc

from ray.serve.exceptions import BackPressureError

from pdserve.errors import (AuthenticationError, CapacityError, InvalidRequestError, KVAuthError, KVIncompatibleError, KVTransferError,
                            ShuttingDownError, WorkerStalledError)


def grpc_status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """(status code, message) for an exception raised on the request path.

    Ray re-raises a worker's exception as a RayTaskError that is also an
    instance of the original class, so isinstance works across the hop.
    """
    if isinstance(exc, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT, error_message(exc)
    if isinstance(exc, AuthenticationError):
        return grpc.StatusCode.UNAUTHENTICATED, error_message(exc)
    if isinstance(exc, CapacityError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, error_message(exc)
    if isinstance(exc, ShuttingDownError):
        return grpc.StatusCode.UNAVAILABLE, error_message(exc)
    if isinstance(exc, BackPressureError):  # a pool's Ray Serve queue is at max_queued_requests
        return grpc.StatusCode.RESOURCE_EXHAUSTED, f"server busy: {error_message(exc)}"
    if isinstance(exc, (KVIncompatibleError, KVAuthError)):  # deployment errors: the pools run different models or secrets
        return grpc.StatusCode.FAILED_PRECONDITION, error_message(exc)
    if isinstance(exc, KVTransferError):
        return grpc.StatusCode.UNAVAILABLE, f"KV transfer failed: {error_message(exc)}"
    if isinstance(exc, WorkerStalledError):  # every replica tried was stuck
        return grpc.StatusCode.UNAVAILABLE, error_message(exc)
    if isinstance(exc, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, error_message(exc) or "deadline exceeded"
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {error_message(exc)}"


def error_message(exc: BaseException) -> str:
    cause = getattr(exc, "cause", None)  # RayTaskError keeps the original here
    return str(cause if cause is not None else exc).strip()


def retry_after_s(exc: BaseException, default_s: float) -> float | None:
    """The retry hint (seconds) for an overload or shutting-down error, None for any other."""
    cause = getattr(exc, "cause", None) or exc
    if isinstance(cause, (CapacityError, ShuttingDownError)):
        return cause.retry_after_s
    if isinstance(exc, BackPressureError):
        return default_s
    return None
