"""A small synchronous gRPC client for the router's Generator service."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import grpc

from pdserve.rpc import generate_pb2 as pb
from pdserve.rpc import generate_pb2_grpc as pb_grpc

DEFAULT_ENDPOINT = "127.0.0.1:9000"


@dataclass
class GenerateResult:
    request_id: str = ""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float = 0.0  # seconds from call to first token
    tpot_s: float = 0.0  # mean seconds per output token after the first


class Client:
    def __init__(self, endpoint: str = DEFAULT_ENDPOINT):
        self.endpoint = endpoint
        self._channel = grpc.insecure_channel(endpoint)
        self._stub = pb_grpc.GeneratorStub(self._channel)

    def health(self, timeout_s: float = 5.0) -> pb.HealthResponse:
        """Raises grpc.RpcError (UNAVAILABLE when nothing listens)."""
        return self._stub.Health(pb.HealthRequest(), timeout=timeout_s)

    def stream(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict[str, str]] | None = None,
        prompt_token_ids: list[int] | None = None,
        request_id: str = "",
        model: str = "",
        timeout_s: float | None = 300.0,
        **params,
    ) -> Iterator[pb.GenerateResponse]:
        """Stream GenerateResponse chunks. ``params`` are SamplingParams fields
        (max_tokens, temperature, top_p, top_k, seed, stop_token_ids, ignore_eos).
        ``request_id`` is echoed back in every chunk; ``model`` must be "" or the served model.

        Raises grpc.RpcError with the server's status (INVALID_ARGUMENT for bad input).
        """
        request = pb.GenerateRequest(
            prompt=prompt or "",
            messages=[pb.ChatMessage(**m) for m in messages or []],
            prompt_token_ids=prompt_token_ids or [],
            params=pb.SamplingParams(**params),
            request_id=request_id,
            model=model,
        )
        return self._stub.Generate(request, timeout=timeout_s)

    def generate(self, prompt: str | None = None, **kwargs) -> GenerateResult:
        """Run one request to the end and collect it, with client-side TTFT and TPOT."""
        result = GenerateResult()
        start = time.perf_counter()
        first_at = last_at = None
        for chunk in self.stream(prompt, **kwargs):
            now = time.perf_counter()
            if chunk.token_ids:
                first_at = first_at or now
                last_at = now
            result.request_id = chunk.request_id
            result.token_ids.extend(chunk.token_ids)
            result.text += chunk.text
            result.finish_reason = chunk.finish_reason or result.finish_reason
            result.prompt_tokens, result.completion_tokens = chunk.prompt_tokens, chunk.completion_tokens
        if first_at is not None:
            result.ttft_s = first_at - start
            if len(result.token_ids) > 1:
                result.tpot_s = (last_at - first_at) / (len(result.token_ids) - 1)
        return result

    def close(self) -> None:
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
