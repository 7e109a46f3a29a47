"""The client gRPC API (``pdserve.rpc.Generator``), served by each router replica itself.

Ray Serve's gRPC proxy does not pass every client cancel on to the replica: with 64 SDK
streams cancelled at random points, a quarter to a third decoded on to ``max_tokens``. Here
``grpc.aio`` cancels a handler's task as soon as its client cancels, disconnects or stops
answering keepalive pings (``router.client_keepalive_s``), and the request path's
``finally`` blocks (router/server.py, router/request_path.py) then stop decode and free both
pools' KV. Ray Serve still places, routes to and autoscales the deployments behind it.

Every router replica listens on ``router.host:router.grpc_port``; replicas on one node share
the port (``SO_REUSEPORT``: the kernel spreads connections over them). Errors carry their
real status code, a retry hint in the ``retry-after`` trailing metadata; bytes that are no
``GenerateRequest`` (invalid UTF-8 in a string field, a cut message) get INVALID_ARGUMENT
with protobuf's reason, where grpcio's own parsing would answer INTERNAL.
"""

from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator, Protocol

import grpc
from google.protobuf.message import DecodeError

from pdserve.rpc import generate_pb2 as pb
from pdserve.rpc import generate_pb2_grpc
from router.admission import metadata_value
from pdserve.config import ClusterConfig
from router.errors import grpc_status_for, retry_after_s

log = logging.getLogger(__name__)


class Service(Protocol):
    """What the front door calls: the router replica (``router.server.Router``)."""

    cfg: ClusterConfig

    def generate_rpc(self, request: pb.GenerateRequest, authorization: str | None) -> AsyncIterator[pb.GenerateResponse]: ...

    async def Health(self, request: pb.HealthRequest) -> pb.HealthResponse: ...


class _Malformed:
    """Request bytes that do not parse as a GenerateRequest; ``reason`` is protobuf's."""

    def __init__(self, reason: str):
        self.reason = reason


def _parse_request(data: bytes) -> pb.GenerateRequest | _Malformed:
    try:
        return pb.GenerateRequest.FromString(data)
    except DecodeError as e:
        return _Malformed(str(e))


def _add_to_server(servicer: "_Generator", server: grpc.aio.Server) -> None:
    """generate_pb2_grpc.add_GeneratorServicer_to_server, with Generate's requests parsed by ``_parse_request``."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate, request_deserializer=_parse_request, response_serializer=pb.GenerateResponse.SerializeToString),
        "Health": grpc.unary_unary_rpc_method_handler(
            servicer.Health, request_deserializer=pb.HealthRequest.FromString, response_serializer=pb.HealthResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("pdserve.rpc.Generator", handlers),))
    server.add_registered_method_handlers("pdserve.rpc.Generator", handlers)


class _Generator(generate_pb2_grpc.GeneratorServicer):
    def __init__(self, router: Service):
        self.router = router

    async def Generate(self, request: pb.GenerateRequest | _Malformed, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        if isinstance(request, _Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the request is not a valid pdserve.rpc.GenerateRequest: {request.reason}")
        responses = self.router.generate_rpc(request, metadata_value(context.invocation_metadata(), "authorization"))
        try:
            async for response in responses:
                yield response
        except Exception as e:  # noqa: BLE001 - every error leaves as a status that names it
            code, message = grpc_status_for(e)
            if code is grpc.StatusCode.INTERNAL:
                log.exception("request failed")
            hint = retry_after_s(e, self.router.cfg.router.retry_after_s)
            if hint is not None:
                context.set_trailing_metadata((("retry-after", f"{hint:g}"),))
            await context.abort(code, message)
        finally:  # a cancelled client lands here too (CancelledError): close the path now, freeing both pools
            await responses.aclose()

    async def Health(self, request: pb.HealthRequest, context: grpc.aio.ServicerContext) -> pb.HealthResponse:
        return await self.router.Health(request)


class GrpcFrontDoor:
    """A ``grpc.aio`` server of ``router``'s Generator API on ``host:port``.

    ``tls``: (cert file, key file, client CA file or None) for TLS, None for plaintext. Binds
    in the constructor (raises OSError naming the address when the port is taken by a process
    that does not share it, OSError for an unreadable TLS file); ``start()`` must then run on
    the replica's event loop.
    """

    def __init__(self, router: Service, host: str, port: int, max_request_bytes: int, keepalive_s: float,
                 tls: tuple[str, str, str | None] | None = None):
        self.server = grpc.aio.server(options=[
            ("grpc.so_reuseport", 1),
            # up to twice router.max_request_bytes reaches the handler, which refuses it with INVALID_ARGUMENT naming
            # the limit; larger ones gRPC refuses before parsing (RESOURCE_EXHAUSTED, "larger than max")
            ("grpc.max_receive_message_length", 2 * max_request_bytes + 1024),
            ("grpc.keepalive_time_ms", int(keepalive_s * 1000)),  # ping a quiet client this often ...
            ("grpc.keepalive_timeout_ms", int(keepalive_s * 1000)),  # ... and drop it (cancelling its streams) if it is gone
            ("grpc.http2.min_ping_interval_without_data_ms", 5000),
            ("grpc.keepalive_permit_without_calls", 1),
        ])
        _add_to_server(_Generator(router), self.server)
        self.address = f"{host}:{port}"
        if tls is None:
            bound = self.server.add_insecure_port(self.address)
        else:  # (cert, key, client CA or None): with a client CA, a client without its certificate fails the handshake
            cert, key, client_ca = (open(path, "rb").read() if path else None for path in tls)
            bound = self.server.add_secure_port(self.address, grpc.ssl_server_credentials(
                [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None))
        if bound == 0:
            raise OSError(f"cannot listen on {self.address} for the client gRPC API (router.host, router.grpc_port)")
        self._started: asyncio.Task | None = None

    def start(self) -> None:
        """Start serving, from the event loop the replica runs its requests on."""
        self._started = asyncio.get_running_loop().create_task(self.server.start())
        log.info("client gRPC API on %s", self.address)
