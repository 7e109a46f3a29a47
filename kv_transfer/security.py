"""Security of the KV channel: a shared secret (``security.kv_secret``) and optional TLS
(``kv_transfer.tls_*``).

The decode side sends the secret as gRPC metadata on every KV call (``with_secret``
wraps its channel); the prefill side's server interceptor (``SecretCheck``) answers a
call without it, or with another one, with UNAUTHENTICATED before any handler runs,
so such a caller learns nothing: not whether a transfer id exists, nor the fingerprint.
"""

from __future__ import annotations

import collections
import hmac

import grpc

METADATA_KEY = "x-pdserve-kv-secret"
DENIED = "KV channel: missing or wrong shared secret (security.kv_secret)"


class SecretCheck(grpc.ServerInterceptor):
    def __init__(self, secret: str):
        self._secret = secret.encode()

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        sent = dict(handler_call_details.invocation_metadata or ()).get(METADATA_KEY, "")
        if handler is None or hmac.compare_digest(sent.encode(), self._secret):
            return handler

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, DENIED)

        def deny_stream(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, DENIED)
            yield  # a generator, as a streaming handler must be

        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(deny_stream, request_deserializer=handler.request_deserializer)
        return grpc.unary_unary_rpc_method_handler(deny, request_deserializer=handler.request_deserializer)


class _CallDetails(collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")),
                   grpc.ClientCallDetails):
    pass


class _AddSecret(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    def __init__(self, secret: str):
        self._metadata = (METADATA_KEY, secret)

    def _details(self, d):
        return _CallDetails(d.method, d.timeout, [*(d.metadata or ()), self._metadata], d.credentials,
                            getattr(d, "wait_for_ready", None), getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)


def with_secret(channel: grpc.Channel, secret: str | None) -> grpc.Channel:
    """``channel`` sending ``secret`` on every call (unchanged if ``secret`` is None)."""
    return channel if secret is None else grpc.intercept_channel(channel, _AddSecret(secret))


def secure_port(server: grpc.Server, address: str, cert_file: str | None, key_file: str | None) -> int:
    """Bind ``address`` with TLS when a certificate is given, in plaintext otherwise; the port (0 = failed)."""
    if not cert_file:
        return server.add_insecure_port(address)
    with open(key_file, "rb") as k, open(cert_file, "rb") as c:
        return server.add_secure_port(address, grpc.ssl_server_credentials([(k.read(), c.read())]))


def channel(address: str, options: list, ca_file: str | None, server_name: str | None) -> grpc.Channel:
    """A channel to a KV server: TLS verified against ``ca_file`` when given (``server_name``:
    the name the server's certificate holds, when it is not ``address``'s host), else plaintext."""
    if not ca_file:
        return grpc.insecure_channel(address, options=options)
    with open(ca_file, "rb") as f:
        credentials = grpc.ssl_channel_credentials(root_certificates=f.read())
    if server_name:
        options = [*options, ("grpc.ssl_target_name_override", server_name)]
    return grpc.secure_channel(address, credentials, options=options)
