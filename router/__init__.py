"""The router: the client-facing gRPC service. It coordinates the pools and never runs the model."""

from router.server import Router

__all__ = ["Router"]
