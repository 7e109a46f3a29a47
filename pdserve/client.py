"""gRPC client SDK for the router's Generator service: ``Client`` (sync) and
``AsyncClient`` (asyncio), with typed results.

- ``stream(...)`` returns a cancellable iterator of ``Chunk`` (new token ids and text);
  ``generate(...)`` collects one request into a ``GenerateResult`` with client-side TTFT
  and TPOT.
- Every call has a deadline (``timeout_s``, seconds, for the whole request).
- A call that fails with UNAVAILABLE (router restarting, proxy not up yet) or
  RESOURCE_EXHAUSTED (overloaded) before its first chunk is retried up to ``retries``
  times within the deadline, after the server's ``retry-after`` hint or an exponential
  backoff; once a chunk has arrived a retry could duplicate output, so errors then go
  to the caller.
- ``api_key``: sent on every call as "authorization: Bearer <key>" when the cluster
  sets ``security.api_key``; without it calls fail with UNAUTHENTICATED.
- Errors are ``grpc.RpcError`` with the server's status: INVALID_ARGUMENT (bad input,
  message names the field), RESOURCE_EXHAUSTED (no capacity, after the retries),
  UNAUTHENTICATED (no or wrong API key), UNAVAILABLE (KV transfer
  failed, or the server is down), FAILED_PRECONDITION (the pools run different models),
  DEADLINE_EXCEEDED.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Iterator

import grpc

from pdserve.rpc import generate_pb2 as pb
from pdserve.rpc import generate_pb2_grpc as pb_grpc
from pdserve.logprobs import TokenLogprob, TopLogprob

DEFAULT_ENDPOINT = "127.0.0.1:9000"


@dataclass(frozen=True)
class Chunk:
    """One streamed piece of a response."""

    request_id: str
    token_ids: list[int]  # new token ids
    text: str  # new text (valid UTF-8; held-back stop-string prefixes never appear)
    finish_reason: str | None  # None until the last chunk: "stop" or "length"
    prompt_tokens: int
    completion_tokens: int  # so far
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token, when requested (logprobs=k)
    index: int = 0  # which choice, with n > 1 (completion_tokens then counts all choices')

    @classmethod
    def from_pb(cls, m: pb.GenerateResponse) -> "Chunk":
        logprobs = [TokenLogprob(lp.token_id, lp.logprob, [TopLogprob(t.token_id, t.logprob) for t in lp.top]) for lp in m.logprobs]
        return cls(m.request_id, list(m.token_ids), m.text, m.finish_reason or None, m.prompt_tokens, m.completion_tokens, logprobs, m.index)


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
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # with n > 1: each choice's tokens, text, logprobs and finish reason, by index (then the
    # fields above keep the request's timing and counts, and its tokens stay empty)
    choices: list[GenerateResult] = field(default_factory=list)

    @classmethod
    def for_choices(cls, n: int | None) -> GenerateResult:
        """An empty result for a request of ``n`` choices."""
        return cls(choices=[cls() for _ in range(n)] if isinstance(n, int) and n > 1 else [])

    def add(self, chunk: Chunk, now: float, start: float, first_at: list[float]) -> None:
        if self.choices:
            self.choices[chunk.index].add(chunk, now, start, first_at[:1] or [now])  # (a choice times from the request's first token)
            self.request_id, self.prompt_tokens, self.completion_tokens = chunk.request_id, chunk.prompt_tokens, chunk.completion_tokens
            self.finish_reason = chunk.finish_reason or self.finish_reason
            if chunk.token_ids and not first_at:
                first_at.append(now)
                self.ttft_s = now - start
            return
        if chunk.token_ids:
            if not first_at:
                first_at.append(now)
                self.ttft_s = now - start
            if len(self.token_ids) + len(chunk.token_ids) > 1:
                self.tpot_s = (now - first_at[0]) / (len(self.token_ids) + len(chunk.token_ids) - 1)
        self.request_id = chunk.request_id
        self.token_ids.extend(chunk.token_ids)
        self.logprobs.extend(chunk.logprobs)
        self.text += chunk.text
        self.finish_reason = chunk.finish_reason or self.finish_reason
        self.prompt_tokens, self.completion_tokens = chunk.prompt_tokens, chunk.completion_tokens


def _structured(json_schema: dict | str | None, json_object: bool, regex: str | None, choice: list[str] | None,
                grammar: str | None) -> dict:
    """The GenerateRequest fields of the structured_output oneof. Raises ValueError where more than one is set."""
    given = {name: value for name, value in (("json_schema", json_schema), ("json_object", json_object or None), ("regex", regex),
                                             ("choice", choice), ("grammar", grammar)) if value is not None}
    if len(given) > 1:
        raise ValueError(f"set at most one of json_schema, json_object, regex, choice and grammar; got {', '.join(given)}")
    if "json_schema" in given and not isinstance(given["json_schema"], str):
        given["json_schema"] = json.dumps(given["json_schema"])
    if "choice" in given:
        if isinstance(choice, str) or not all(isinstance(c, str) for c in choice):
            raise TypeError("choice must be a list of strings")
        given["choice"] = pb.Choices(choices=list(choice))
    return given


def build_request(prompt: str | None = None, *, messages: list[dict[str, str]] | None = None,
                  prompt_token_ids: list[int] | None = None, request_id: str = "", model: str = "",
                  json_schema: dict | str | None = None, json_object: bool = False, regex: str | None = None,
                  choice: list[str] | None = None, grammar: str | None = None, **params) -> pb.GenerateRequest:
    """``params``: SamplingParams fields (max_tokens, temperature, top_p, top_k, seed,
    min_tokens, stop, stop_token_ids, ignore_eos, logprobs, repetition_penalty, presence_penalty,
    frequency_penalty, min_p, n (choices; each chunk has its index), and logit_bias as {token
    id: bias}). Raises ValueError for an
    unknown one or a value out of its field's range (``seed`` is an int64, ``max_tokens`` an int32,
    the float ones float32: a nonzero value that would arrive as 0 or inf is refused), TypeError
    naming the parameter for a value of the wrong type.

    Structured output, at most one: ``json_schema`` (a JSON Schema, as a dict or JSON text),
    ``json_object`` (any JSON object), ``regex`` (the whole output matches it), ``choice`` (one
    of these strings) or ``grammar`` (Lark, or GBNF with ``::=`` rules); docs/structured_output.md."""
    structured = _structured(json_schema, json_object, regex, choice, grammar)
    sampling = pb.SamplingParams()
    if isinstance(params.get("stop"), str):  # as OpenAI's: one stop string (else protobuf would take each character)
        params["stop"] = [params["stop"]]
    for name, value in params.items():
        if name not in pb.SamplingParams.DESCRIPTOR.fields_by_name:
            raise ValueError(f"unknown sampling parameter: {name!r}")
        try:
            sampling.MergeFrom(pb.SamplingParams(**{name: value}))
        except (TypeError, ValueError) as e:  # protobuf: TypeError for a wrong type, ValueError out of range
            raise type(e)(f"sampling parameter {name}={value!r}: {e}") from None
        sent = getattr(sampling, name)
        if isinstance(sent, float) and isinstance(value, (int, float)) and math.isfinite(value) and value != 0 and (sent == 0 or math.isinf(sent)):
            raise ValueError(f"sampling parameter {name}={value!r}: out of the float32 field's range (it would arrive as {sent})")
    return pb.GenerateRequest(
        prompt=prompt or "", messages=[pb.ChatMessage(**m) for m in messages or []],
        prompt_token_ids=prompt_token_ids or [], params=sampling, request_id=request_id, model=model, **structured,
    )


RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)


_HINT = re.compile(r"retry after ([0-9.]+) s")


def server_retry_after_s(e: grpc.RpcError) -> float | None:
    """The server's retry hint, seconds: its ``retry-after`` trailing metadata, or the
    "retry after N s" in its message (a proxy in between may drop trailing metadata), if
    any."""
    try:
        hint = next((v for k, v in e.trailing_metadata() or () if k == "retry-after"), None)
        if hint is None:
            match = _HINT.search(e.details() or "")
            hint = match.group(1) if match else None
        return float(hint) if hint is not None else None
    except (AttributeError, TypeError, ValueError):
        return None


def _retryable(e: grpc.RpcError, got_any: bool, attempt: int, retries: int, deadline: float, backoff_s: float) -> float | None:
    """Seconds to wait before retrying, or None to raise. Only UNAVAILABLE and RESOURCE_EXHAUSTED
    before the first chunk are retried: the server's retry hint first, else exponential backoff."""
    if got_any or e.code() not in RETRYABLE or attempt >= retries:
        return None
    wait = server_retry_after_s(e) or backoff_s * 2**attempt
    return wait if time.monotonic() + wait < deadline else None


class _Call:
    """One request's call state, shared by Stream and AsyncStream."""

    def __init__(self, stub, request: pb.GenerateRequest, timeout_s: float, retries: int, backoff_s: float, metadata=()):
        self._stub, self._request, self._metadata = stub, request, tuple(metadata)
        self._deadline = time.monotonic() + timeout_s
        self._retries, self._backoff_s = retries, backoff_s
        self._call = None
        self._cancelled = self._iterated = False

    def _claim(self) -> None:
        """A stream sends its request once: iterating it again would send a second one."""
        if self._iterated:
            raise RuntimeError("this stream was already iterated; call stream() again for another request")
        self._iterated = True

    def _start(self):
        self._call = self._stub.Generate(self._request, timeout=max(0.001, self._deadline - time.monotonic()), metadata=self._metadata)
        if self._cancelled:
            self._call.cancel()
        return self._call

    def _retry_after(self, e: grpc.RpcError, got_any: bool, attempt: int) -> float | None:
        return None if self._cancelled else _retryable(e, got_any, attempt, self._retries, self._deadline, self._backoff_s)

    def cancel(self) -> None:
        """End the request; the server frees its KV and queue places. Iteration then stops
        without an error."""
        self._cancelled = True
        if self._call is not None:
            self._call.cancel()


class Stream(_Call):
    """Iterator of Chunk for one request, iterated once; ``cancel()`` ends it (the server frees
    everything), and so does leaving the loop early. Raises RuntimeError when iterated again."""

    def __iter__(self) -> Iterator[Chunk]:
        self._claim()
        attempt, got_any = 0, False
        while True:
            try:
                for message in self._start():
                    got_any = True
                    try:
                        yield Chunk.from_pb(message)
                    except GeneratorExit:  # the caller left the loop (break, return, an exception)
                        self.cancel()
                        raise
                return
            except grpc.RpcError as e:
                if self._cancelled and e.code() == grpc.StatusCode.CANCELLED:
                    return  # our own cancel(): the stream just ends
                wait = self._retry_after(e, got_any, attempt)
                if wait is None:
                    raise
                attempt += 1
                time.sleep(wait)


def _tls(ca_file: str | None, cert_file: str | None, key_file: str | None) -> grpc.ChannelCredentials | None:
    """TLS credentials for a server with ``router.tls_*`` set: ``ca_file`` verifies the
    server (None: the system's roots), ``cert_file``/``key_file`` are this client's
    certificate for mTLS. None (plaintext) when none of the three is given."""
    if not (ca_file or cert_file or key_file):
        return None
    read = lambda path: open(path, "rb").read() if path else None  # noqa: E731
    return grpc.ssl_channel_credentials(read(ca_file), read(key_file), read(cert_file))


def _auth_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


class Client:
    """Synchronous client. ``retries``: retries of UNAVAILABLE and RESOURCE_EXHAUSTED before
    the first chunk; ``api_key``: sent as "authorization: Bearer <key>" (security.api_key);
    ``tls_ca_file`` (and ``tls_cert_file``/``tls_key_file`` for mTLS): connect over TLS
    (router.tls_*). Raises OSError for an unreadable TLS file."""

    def __init__(self, endpoint: str = DEFAULT_ENDPOINT, *, retries: int = 3, backoff_s: float = 0.5, api_key: str | None = None,
                 tls_ca_file: str | None = None, tls_cert_file: str | None = None, tls_key_file: str | None = None):
        self.endpoint = endpoint
        self.retries, self.backoff_s = retries, backoff_s
        self._metadata = _auth_metadata(api_key)
        credentials = _tls(tls_ca_file, tls_cert_file, tls_key_file)
        self._channel = grpc.secure_channel(endpoint, credentials) if credentials else grpc.insecure_channel(endpoint)
        self._stub = pb_grpc.GeneratorStub(self._channel)

    def health(self, timeout_s: float = 5.0) -> pb.HealthResponse:
        """Raises grpc.RpcError (UNAVAILABLE when nothing listens)."""
        return self._stub.Health(pb.HealthRequest(), timeout=timeout_s, metadata=self._metadata)

    def stream(self, prompt: str | None = None, *, timeout_s: float = 300.0, **kwargs) -> Stream:
        """Stream one request: exactly one of ``prompt`` (raw text), ``messages`` (chat,
        template applied) or ``prompt_token_ids``; ``request_id`` is only echoed back;
        ``model`` must be "" or the served model; ``json_schema``, ``json_object``, ``regex``,
        ``choice`` or ``grammar`` constrain the output (``build_request``); other keywords are
        sampling parameters."""
        return Stream(self._stub, build_request(prompt, **kwargs), timeout_s, self.retries, self.backoff_s, self._metadata)

    def generate(self, prompt: str | None = None, **kwargs) -> GenerateResult:
        """Run one request to the end and collect it (see ``stream`` for the arguments); with
        ``n`` > 1, each choice in ``choices``."""
        result, start, first_at = GenerateResult.for_choices(kwargs.get("n")), time.perf_counter(), []
        for chunk in self.stream(prompt, **kwargs):
            result.add(chunk, time.perf_counter(), start, first_at)
        return result

    def close(self) -> None:
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _current_task_cancelling() -> bool:
    """Whether the running task itself is being cancelled (then CancelledError must propagate)."""
    task = asyncio.current_task()
    return bool(task is not None and getattr(task, "cancelling", lambda: 0)())


class AsyncStream(_Call):
    """Async iterator of Chunk for one request, iterated once; ``cancel()`` ends it, and so
    does leaving the loop early (when the event loop finalizes the iterator, or at once with
    ``contextlib.aclosing``). Raises RuntimeError when iterated again."""

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        self._claim()
        attempt, got_any = 0, False
        while True:
            try:
                async for message in self._start():
                    got_any = True
                    try:
                        yield Chunk.from_pb(message)
                    except GeneratorExit:
                        self.cancel()
                        raise
                return
            except asyncio.CancelledError:
                if self._cancelled and not _current_task_cancelling():
                    return  # our own cancel() (grpc.aio raises CancelledError for it): the stream just ends
                raise
            except grpc.RpcError as e:
                wait = self._retry_after(e, got_any, attempt)
                if wait is None:
                    raise
                attempt += 1
                await asyncio.sleep(wait)


class AsyncClient:
    """asyncio client (grpc.aio); same arguments and results as ``Client``."""

    def __init__(self, endpoint: str = DEFAULT_ENDPOINT, *, retries: int = 3, backoff_s: float = 0.5, api_key: str | None = None,
                 tls_ca_file: str | None = None, tls_cert_file: str | None = None, tls_key_file: str | None = None):
        self.endpoint = endpoint
        self.retries, self.backoff_s = retries, backoff_s
        self._metadata = _auth_metadata(api_key)
        credentials = _tls(tls_ca_file, tls_cert_file, tls_key_file)
        self._channel = grpc.aio.secure_channel(endpoint, credentials) if credentials else grpc.aio.insecure_channel(endpoint)
        self._stub = pb_grpc.GeneratorStub(self._channel)

    async def health(self, timeout_s: float = 5.0) -> pb.HealthResponse:
        return await self._stub.Health(pb.HealthRequest(), timeout=timeout_s, metadata=self._metadata)

    def stream(self, prompt: str | None = None, *, timeout_s: float = 300.0, **kwargs) -> AsyncStream:
        return AsyncStream(self._stub, build_request(prompt, **kwargs), timeout_s, self.retries, self.backoff_s, self._metadata)

    async def generate(self, prompt: str | None = None, **kwargs) -> GenerateResult:
        result, start, first_at = GenerateResult.for_choices(kwargs.get("n")), time.perf_counter(), []
        async for chunk in self.stream(prompt, **kwargs):
            result.add(chunk, time.perf_counter(), start, first_at)
        return result

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()
