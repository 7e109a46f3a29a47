"""Router: the ingress deployment serving ``pdserve.rpc.Generator`` on Ray Serve's gRPC proxy.

The request path is one linear coroutine (``_generate``):
tokenize + validate -> prefill pool (first token, KV handle) -> decode pool
(fetches the KV, streams the rest) -> detokenize and stream to the client.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any, AsyncIterator

from transformers import AutoConfig

from pdserve.config import ClusterConfig
from pdserve.detokenizer import IncrementalDetokenizer
from pdserve.errors import InvalidRequestError
from pdserve.messages import DecodeRequest, PrefillRequest
from pdserve.model_loader import load_tokenizer, resolve_model_dir
from pdserve.rpc import generate_pb2 as pb
from pdserve.sampling import SamplingParams
from pdserve.worker import max_model_len
from router.errors import grpc_status_for

log = logging.getLogger(__name__)


CHAT_ROLES = ("system", "user", "assistant", "tool")


def served_model_name(cfg: ClusterConfig) -> str:
    return cfg.model.path.rstrip("/").rsplit("/", 1)[-1].removesuffix(".gguf")


class Router:
    def __init__(self, prefill, decode, config: dict[str, Any]):
        self.prefill = prefill  # DeploymentHandle of PrefillServer
        self.decode = decode  # DeploymentHandle of DecodeServer
        self.cfg = ClusterConfig.from_dict(config)
        model_dir = resolve_model_dir(self.cfg.model.path)
        self.tokenizer = load_tokenizer(model_dir)
        model_config = AutoConfig.from_pretrained(model_dir)
        self.vocab_size = model_config.vocab_size
        self.max_model_len = max_model_len(self.cfg, model_config)
        self.model_name = served_model_name(self.cfg)

    # -- parsing ---------------------------------------------------------------

    def _prompt_ids(self, request: pb.GenerateRequest) -> list[int]:
        given = [bool(request.prompt), bool(request.messages), bool(request.prompt_token_ids)]
        if sum(given) > 1:
            raise InvalidRequestError("set only one of prompt, messages and prompt_token_ids")
        if request.messages:
            for m in request.messages:
                if m.role not in CHAT_ROLES:
                    raise InvalidRequestError(f"message role {m.role!r} is not one of {', '.join(CHAT_ROLES)}")
            if not any(m.content.strip() for m in request.messages):
                raise InvalidRequestError("prompt is empty: every message has empty content")
            messages = [{"role": m.role, "content": m.content} for m in request.messages]
            return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])
        if request.prompt_token_ids:
            ids = list(request.prompt_token_ids)
            self._check_token_ids("prompt_token_ids", ids)
            return ids
        return list(self.tokenizer(request.prompt).input_ids) if request.prompt else []

    def _check_token_ids(self, field: str, ids: list[int]) -> None:
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"{field} has {bad[0]}, outside the vocabulary of {self.vocab_size}")

    def _params(self, p: pb.SamplingParams) -> SamplingParams:
        self._check_token_ids("stop_token_ids", list(p.stop_token_ids))
        return SamplingParams(
            stop_token_ids=tuple(p.stop_token_ids), ignore_eos=p.ignore_eos,
            **{name: getattr(p, name) for name in ("max_tokens", "temperature", "top_p", "top_k", "seed") if p.HasField(name)},
        )

    def _parse(self, request: pb.GenerateRequest) -> tuple[list[int], SamplingParams]:
        if request.model and request.model != self.model_name:
            raise InvalidRequestError(f"unknown model {request.model!r}; this cluster serves {self.model_name!r}")
        prompt_ids = self._prompt_ids(request)
        params = self._params(request.params)
        params.validate(len(prompt_ids), self.max_model_len)
        return prompt_ids, params

    # -- gRPC methods ------------------------------------------------------------

    async def Generate(self, request: pb.GenerateRequest, grpc_context=None) -> AsyncIterator[pb.GenerateResponse]:
        try:
            prompt_ids, params = self._parse(request)
            # Internal ids are always unique; the client's request_id is only echoed back.
            internal_id = uuid.uuid4().hex
            async for response in self._generate(internal_id, request.request_id or internal_id, prompt_ids, params):
                yield response
        except Exception as e:
            code, message = grpc_status_for(e)
            if code.name == "INTERNAL":
                log.exception("request failed")
            if grpc_context is not None:  # Ray Serve sends this status instead of INTERNAL
                grpc_context.set_code(code)
                grpc_context.set_details(message)
            raise

    async def Health(self, request: pb.HealthRequest, grpc_context=None) -> pb.HealthResponse:
        return pb.HealthResponse(ok=True, model=self.model_name, max_model_len=self.max_model_len)

    # -- the request path -------------------------------------------------------

    async def _generate(
        self, request_id: str, client_request_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[pb.GenerateResponse]:
        detok = IncrementalDetokenizer(self.tokenizer)
        num_prompt, num_generated = len(prompt_ids), 0

        def response(token_ids: list[int], finish_reason: str | None) -> pb.GenerateResponse:
            nonlocal num_generated
            num_generated += len(token_ids)
            text = detok.add(token_ids) + (detok.finish() if finish_reason else "")
            return pb.GenerateResponse(
                request_id=client_request_id, token_ids=token_ids, text=text, finish_reason=finish_reason or "",
                prompt_tokens=num_prompt, completion_tokens=num_generated,
            )

        first = await self.prefill.prefill.remote(PrefillRequest(request_id, prompt_ids, params))
        if first.finish_reason is not None:  # done after one token: decode never runs
            yield response([] if first.finish_reason == "stop" else [first.first_token], first.finish_reason)
            return
        stream, finished = None, False
        try:
            yield response([first.first_token], None)
            decode_request = DecodeRequest(request_id, prompt_ids, first.first_token, params, first.kv)
            stream = self.decode.options(stream=True).generate.remote(decode_request)
            async for chunk in stream:
                finished = chunk.finish_reason is not None
                yield response(chunk.token_ids, chunk.finish_reason)
        finally:
            if not finished:  # cancelled or failed: free both sides now (a no-op where already freed)
                if stream is not None:
                    stream.cancel()
                self.prefill.release.remote(first.kv.transfer_id)
