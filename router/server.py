"""Router: the ingress deployment. It serves ``pdserve.rpc.Generator`` itself
(router/grpc_server.py) and the OpenAI-compatible HTTP API (router/openai_api.py) on Ray
Serve's HTTP proxy.

The request path: tokenize + validate + admit (here) -> prefill pool (first token, KV
handle) -> decode pool (fetches the KV, streams the rest) (``RequestPath.stream`` in
router/request_path.py, with retries and migration) -> detokenize, apply stop strings,
stream to the client (``generate`` here, as typed ``Output``s each client API renders: router/frontend.py).

(No ``from __future__ import annotations`` here: FastAPI reads the route signatures'
annotations at runtime, through Ray Serve's class-based ingress.)
"""


import asyncio
import logging
import threading
import time
import uuid
from pathlib import Path
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from ray import serve
from transformers import AutoConfig

from kv_transfer.factory import make_receiver
from router import http
from router import openai_api as oa

from pdserve.callers import this_actor
from pdserve.config import ClusterConfig, ConfigError
from pdserve.detokenizer import IncrementalDetokenizer
from pdserve.errors import InvalidRequestError
from pdserve.messages import ALL_CHOICES
from pdserve.metrics import RouterMetrics
from pdserve.model_loader import load_tokenizer, resolve_model_dir
from pdserve.replica_log import to_replica_log
from pdserve.rpc import generate_pb2 as pb
from pdserve.sampling import SamplingParams
from pdserve.structured import StructuredOutput
from pdserve.worker import max_model_len
from router.admission import Admission
from router.disconnect import Receive, follow
from router.draining import Drain
from router.frontend import Frontend, Output
from router.grpc_server import GrpcFrontDoor
from router.placement import PrefillPlacement
from router.replica_calls import ToReplica
from router.request_path import RequestPath
from router.retries import RetryPolicy
from router.stop_strings import StopStringMatcher

log = logging.getLogger(__name__)



# pb.SamplingParams' optional fields, each passed on to SamplingParams when set
_OPTIONAL_PARAMS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "min_tokens", "logprobs",
                    "repetition_penalty", "presence_penalty", "frequency_penalty", "min_p", "n")


def _logprob_pb(lp) -> pb.TokenLogprob:
    return pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])


def chat_template(value: str | None) -> str | None:
    """model.chat_template: the template itself (it has Jinja's ``{{`` or ``{%``), or a file
    on this node holding it. Raises ConfigError for a path that cannot be read."""
    if value is None or "{{" in value or "{%" in value:
        return value
    try:
        return Path(value).expanduser().read_text()
    except OSError as e:
        raise ConfigError(f"model.chat_template: {e}") from None


def served_model_name(cfg: ClusterConfig) -> str:
    return cfg.model.path.rstrip("/").rsplit("/", 1)[-1].removesuffix(".gguf")


app = FastAPI(title="pdserve", description="OpenAI-compatible API of a disaggregated prefill/decode cluster")


@app.exception_handler(StarletteHTTPException)
async def _http_exception(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Unknown routes and methods answer in OpenAI's error shape too."""
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return JSONResponse(oa.error_body(f"{exc.detail}: {request.method} {request.url.path}", kind, exc.status_code), status_code=exc.status_code)


@serve.ingress(app)
class Router:
    def __init__(self, prefill, decode, config: dict[str, Any]):
        to_replica_log()  # this replica's INFO lines (model, weights, KV pool) in its Serve log
        self.cfg = ClusterConfig.from_dict(config)
        model_dir = resolve_model_dir(self.cfg.model.path)
        self.tokenizer = load_tokenizer(model_dir)
        model_config = AutoConfig.from_pretrained(model_dir)
        self.max_model_len = max_model_len(self.cfg, model_config)
        self.model_name = served_model_name(self.cfg)
        self.frontend = Frontend(self.tokenizer, self.model_name, self.max_model_len, model_config.vocab_size,
                                 chat_template(self.cfg.model.chat_template), self.cfg.model.tool_parser)
        # structured output's grammar tables (1-2 s): built beside start-up; a constrained request waits for them
        threading.Thread(target=lambda: self.frontend.grammars, name="grammars", daemon=True).start()
        self.created = int(time.time())
        self.metrics = RouterMetrics(self.model_name)
        r = self.cfg.router
        # prefill: DeploymentHandle of PrefillServer (None in colocated mode); decode: of DecodeServer
        decode_pool = self.cfg.colocated if self.cfg.mode == "colocated" else self.cfg.decode
        self.path = RequestPath(prefill, decode,
                                RetryPolicy.for_pool(self.cfg.prefill, r.max_retries, r.retry_backoff_s, exponential=True),
                                RetryPolicy.for_pool(decode_pool, r.max_retries, r.retry_backoff_s, exponential=False),
                                self.cfg.kv_transfer.layerwise,
                                make_receiver(self.cfg.kv_transfer, secret=self.cfg.security.kv_secret) if prefill is not None else None,
                                PrefillPlacement(r.local_prefill_max_tokens, r.local_prefill_queue_s, r.max_local_prefills,
                                                 lambda where: self.metrics.placement.inc(tags={"where": where})),
                                this_actor())
        self.admission = Admission(r.max_in_flight, r.retry_after_s, r.max_request_bytes, self.cfg.security.api_key,
                                   r.max_queue_s, self.path.placement.prefill_wait_s)
        self.draining = Drain(lambda: self.admission.num_in_flight, r.retry_after_s)  # `pdserve down` (router/draining.py)
        tls = (r.tls_cert_file, r.tls_key_file, r.tls_client_ca_file) if r.tls_cert_file else None
        self.grpc = GrpcFrontDoor(self, r.host, r.grpc_port, r.max_request_bytes, r.client_keepalive_s, tls)
        self.grpc.start()  # Ray Serve runs this constructor on the replica's event loop

    # -- gRPC ----------------------------------------------------------------

    def _prompt_ids(self, request: pb.GenerateRequest) -> list[int]:
        given = [bool(request.prompt), bool(request.messages), bool(request.prompt_token_ids)]
        if sum(given) > 1:
            raise InvalidRequestError("set only one of prompt, messages and prompt_token_ids")
        if request.messages:
            return self.frontend.chat_ids([(m.role, m.content) for m in request.messages])
        if request.prompt_token_ids:
            ids = list(request.prompt_token_ids)
            self.frontend.check_token_ids("prompt_token_ids", ids)
            return ids
        return self.frontend.text_ids(request.prompt)

    def _params(self, p: pb.SamplingParams) -> SamplingParams:
        return SamplingParams(
            stop_token_ids=tuple(p.stop_token_ids), ignore_eos=p.ignore_eos, stop=tuple(p.stop), logit_bias=dict(p.logit_bias),
            **{name: getattr(p, name) for name in _OPTIONAL_PARAMS if p.HasField(name)},
        )

    @staticmethod
    def _structured(request: pb.GenerateRequest) -> StructuredOutput | None:
        """The request's structured_output oneof, or None (json_object false is unset)."""
        which = request.WhichOneof("structured_output")
        if which is None or (which == "json_object" and not request.json_object):
            return None
        if which == "json_object":
            return StructuredOutput("json_object")
        if which == "choice":
            return StructuredOutput("choice", choices=tuple(request.choice.choices))
        return StructuredOutput({"json_schema": "json"}.get(which, which), getattr(request, which))

    def _parse(self, request: pb.GenerateRequest) -> tuple[list[int], SamplingParams]:
        self.frontend.check_model(request.model)
        prompt_ids = self._prompt_ids(request)
        params = self._params(request.params)
        params.structured = self._structured(request)
        self.frontend.validate(prompt_ids, params)
        return prompt_ids, params

    async def generate_rpc(self, request: pb.GenerateRequest, authorization: str | None) -> AsyncIterator[pb.GenerateResponse]:
        """One gRPC Generate call (router/grpc_server.py serves it); raises what the request
        path raises, which the server maps to a status (router/errors.py)."""
        self.admission.authenticate(authorization)
        self.admission.check_size(request.ByteSize())
        prompt_ids, params = await asyncio.to_thread(self._parse, request)  # tokenizing stays off the event loop
        # Internal ids are always unique; the client's request_id is only echoed back.
        internal_id = uuid.uuid4().hex
        client_id = request.request_id or internal_id
        outputs = self.generate(prompt_ids, params, internal_id)
        try:
            async for o in outputs:
                yield pb.GenerateResponse(
                    request_id=client_id, token_ids=o.token_ids, text=o.text, finish_reason=o.finish_reason or "",
                    prompt_tokens=o.prompt_tokens, completion_tokens=o.completion_tokens, logprobs=[_logprob_pb(lp) for lp in o.logprobs],
                    index=o.index)
        finally:  # at once, not at garbage collection: a client that left frees both pools now
            await outputs.aclose()

    async def Health(self, request: pb.HealthRequest) -> pb.HealthResponse:
        return pb.HealthResponse(ok=True, model=self.model_name, max_model_len=self.max_model_len)

    async def drain(self, target: ToReplica, drain_s: float) -> dict[str, int]:
        """``pdserve down``'s drain of this replica (``target`` names it; router/replica_calls.py
        routes the call): new requests are refused, those in flight get ``drain_s`` seconds,
        the rest end with an error (router/draining.py). Returns its counts. Raises
        ValueError if ``target`` is another replica."""
        me = serve.get_replica_context().replica_id.unique_id
        if target.unique_id != me:
            raise ValueError(f"a drain for router replica {target.unique_id} reached {me}")
        log.info("draining: %d requests in flight get %g s", self.admission.num_in_flight, drain_s)
        counts = await self.draining.run(drain_s)
        log.info("drained: %s", counts)
        return counts

    async def stats(self) -> dict[str, int]:
        """Admission, retry and migration counters (for tests and operators, through a deployment handle)."""
        placement = self.path.placement.stats
        return {**self.admission.stats(), "draining": int(self.draining.draining), "num_prefill_retries": self.path.num_prefill_retries, "num_migrations": self.path.num_migrations,
                "num_resent": self.path.num_resent, "num_prefill_remote": placement.num_remote,
                "num_prefill_local_short": placement.num_local_short, "num_prefill_local_queued": placement.num_local_queued}

    # -- OpenAI-compatible HTTP -------------------------------------------------

    @app.get("/health")
    async def http_health(self) -> dict:
        return {"status": "ok", "model": self.model_name}

    @app.get("/v1/models")
    async def http_models(self, request: Request):
        try:
            self.admission.authenticate(request.headers.get("authorization"))
        except Exception as e:  # noqa: BLE001 - answered in OpenAI's shape
            return http.error_response(e)
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "pdserve", "max_model_len": self.max_model_len}]}

    @app.post("/v1/completions")
    async def http_completions(self, request: Request):
        return await self._http(request, chat=False)

    @app.post("/v1/chat/completions")
    async def http_chat_completions(self, request: Request):
        return await self._http(request, chat=True)

    async def _http(self, request: Request, chat: bool):
        try:  # before reading the body: a refused request costs nothing
            self.admission.authenticate(request.headers.get("authorization"))
            self.admission.check_size(int(request.headers.get("content-length") or 0))
            body = await request.body()
            self.admission.check_size(len(body))
        except Exception as e:  # noqa: BLE001 - answered in OpenAI's shape
            return http.error_response(e)
        return await http.handle(self.frontend, self.generate, body, chat=chat, receive=request.receive)

    # -- the request path -------------------------------------------------------

    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
                       receive: Receive | None = None) -> AsyncIterator[Output]:
        """One request's answer as it is made, for both client APIs (router/frontend.py):
        ``prompt_ids`` and ``params`` checked by the Frontend; ``request_id`` the internal id
        (unique; a new one if None); ``receive``: an HTTP request's ASGI receive, watched for
        the client leaving. Raises ShuttingDownError while the router drains, CapacityError
        when admission refuses it (both at once), then what the request path raises, or
        ShuttingDownError if the drain's deadline passes first. Close it early and both
        pools free the request."""
        request_id = request_id or uuid.uuid4().hex
        self.draining.check()
        self.admission.admit(request_id)  # CapacityError here, before anything is spent, when the router is full or queued
        chunks = follow(self._generate_admitted(request_id, prompt_ids, params), receive, self.draining.expired)
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            await chunks.aclose()  # at once: a client that left frees both pools now
            self.admission.release(request_id)

    async def _generate_admitted(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[Output]:
        # per choice (n > 1: by index): its detokenizer and stop strings; ended once it has finished
        texts = [(IncrementalDetokenizer(self.tokenizer), StopStringMatcher(params.stop)) for _ in range(params.n)]
        ended: set[int] = set()
        num_prompt, num_generated = len(prompt_ids), 0
        start = last_token_at = time.perf_counter()
        reason = "abort"  # until a chunk says otherwise

        def response(index: int, token_ids: list[int], finish_reason: str | None, logprobs=None) -> Output:
            nonlocal num_generated, last_token_at, reason
            detok, stop = texts[index]
            token_ids, logprobs = list(token_ids), list(logprobs or ())
            # with stop strings, token by token: a chunk (decode.stream_interval) ends at the token that completes a match
            pieces, text = [[t] for t in token_ids] if stop.stop and token_ids else [token_ids], ""
            for i, piece in enumerate(pieces):
                text += stop.push(detok.add(piece) + (detok.finish() if finish_reason and i == len(pieces) - 1 else ""))
                if stop.matched is not None:
                    token_ids, logprobs = token_ids[: i + 1], logprobs[: i + 1]
                    break
            if stop.matched is not None:
                finish_reason = "stop"
            elif finish_reason:
                text += stop.flush()
            now = time.perf_counter()
            if token_ids:
                if num_generated == 0:
                    self.metrics.ttft.observe(now - start)
                else:
                    for _ in token_ids:  # one gap per token, as vLLM counts it
                        self.metrics.itl.observe((now - last_token_at) / len(token_ids))
                last_token_at = now
                self.metrics.generation_tokens.inc(len(token_ids))
            num_generated += len(token_ids)
            if num_generated >= 2 or finish_reason:  # decode's first token (prefill samples the first), or the end
                self.admission.decoding(request_id)
            if finish_reason:
                reason = finish_reason
                ended.add(index)
            return Output(token_ids, text, finish_reason, num_prompt, num_generated, logprobs, index)

        self.metrics.prompt_tokens.inc(num_prompt)
        items = self.path.stream(request_id, prompt_ids, params)
        try:
            async for item in items:
                if item.index == ALL_CHOICES and params.n > 1:  # aborted: every open choice ends
                    for index in sorted(set(range(params.n)) - ended):
                        yield response(index, [], item.finish_reason)
                    return
                index = item.index if params.n > 1 else 0
                if index in ended:  # a choice that a stop string ended: decode's tokens after it are dropped
                    continue
                chunk = response(index, item.token_ids, item.finish_reason, item.logprobs)
                yield chunk
                if len(ended) == params.n:  # finished, or a stop string: closing the path frees both pools
                    return
        finally:
            await items.aclose()  # now, not at garbage collection: frees both pools' KV
            self.metrics.finished.inc(tags={"finished_reason": reason})
            self.metrics.e2e.observe(time.perf_counter() - start)
