"""OpenAI-compatible HTTP API: request parsing, response and SSE chunk shapes, errors.

Served by the router deployment as a FastAPI ingress on Ray Serve's HTTP proxy
(router/server.py holds the routes). Endpoints: ``/v1/completions``,
``/v1/chat/completions``, ``/v1/models``, ``/health``. Shapes follow the OpenAI API
reference (https://platform.openai.com/docs/api-reference); sampling extensions that
vLLM also accepts (``top_k``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``,
``repetition_penalty``, ``min_p``) pass through; ``logit_bias`` takes token ids as strings, as
OpenAI's does, each bias clamped to [-100, 100] as vLLM's server does. Structured output:
OpenAI's ``response_format`` (``text``, ``json_object``, ``json_schema``) or vLLM's
``structured_outputs`` (one of ``json``, ``regex``, ``choice``, ``grammar``, ``json_object``),
not both. Chat takes ``tools``, ``tool_choice`` and ``parallel_tool_calls``, and messages with
``tool_calls`` and ``tool_call_id`` (router/tool_calls.py). A parameter pdserve does not
implement is accepted at its neutral value (what OpenAI does when it is left out: no
``functions``, ``n: 1``, ...), as OpenAI and vLLM accept it and
client libraries send it by default; set to anything else, it is refused with a 400
naming it, never silently ignored.
"""

from __future__ import annotations

import json
import math
import re
import time
import uuid
from typing import Any, Union

from pydantic import BaseModel, ConfigDict, ValidationError
from ray.serve.exceptions import BackPressureError

from pdserve.errors import (AuthenticationError, CapacityError, InvalidRequestError, KVAuthError, KVIncompatibleError, KVTransferError,
                            RequestTooLargeError, ShuttingDownError, WorkerStalledError)
from pdserve.sampling import MAX_LOGIT_BIAS, MAX_LOGPROBS, SamplingParams
from pdserve.structured import StructuredOutput
from router import tool_calls


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown keys are refused by name (_Common.unsupported), not dropped
    include_usage: bool = False


# Fields OpenAI clients send that change nothing here; any other unknown field is refused.
IGNORED_FIELDS = {"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"}


def _neutral(name: str, value: Any, body: dict[str, Any]) -> bool:
    """Whether an unimplemented field ``name`` is sent with the value that changes nothing:
    plain-text output, no tools (and so no tool choice or parallel tool calls), no functions.
    ``body``: the request's other unknown fields (tool_choice is neutral only without tools)."""
    no_tools = not body.get("tools") and not body.get("functions")
    if value is None:
        return True
    if name in ("tools", "functions"):
        return value == []
    if name in ("tool_choice", "function_call"):
        return value == "none" or (value == "auto" and no_tools)
    if name == "parallel_tool_calls":
        return isinstance(value, bool) and no_tools
    return False


class _Common(BaseModel):
    # strict: "10" is not a number and true is not a count; null means "the default"
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None  # None or "": the served model
    max_tokens: int | None = None
    temperature: float | None = None  # None: 1.0, as OpenAI
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_p: float | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None

    def unsupported(self) -> list[str]:
        """Parameters set to something pdserve does not implement, and unknown ones."""
        bad = [f"stream_options.{k}" for k in (self.stream_options.model_extra or {})] if self.stream_options else []
        extra = self.model_extra or {}
        return bad + sorted(k for k, v in extra.items() if k not in IGNORED_FIELDS and not _neutral(k, v, extra))

    def num_logprobs(self) -> int | None:
        return None

    def _logit_bias(self) -> dict[int, float]:
        """OpenAI's {"token id": bias} as {id: bias}, clamped to [-100, 100] as vLLM's server
        does (a NaN stays, for SamplingParams.validate to refuse)."""
        out = {}
        for key, bias in (self.logit_bias or {}).items():
            try:
                token = int(key)
            except ValueError:
                raise InvalidRequestError(f"logit_bias key {key!r} is not a token id") from None
            out[token] = bias if math.isnan(bias) else min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, bias))
        return out

    def structured(self) -> StructuredOutput | None:
        """``response_format`` or ``structured_outputs`` as a StructuredOutput (None for free text).
        Raises InvalidRequestError naming the field that is wrong."""
        if self.response_format is not None and self.structured_outputs is not None:
            raise InvalidRequestError("response_format and structured_outputs: set one of them, not both")
        if self.response_format is not None:
            return _response_format(self.response_format)
        if self.structured_outputs is not None:
            return _structured_outputs(self.structured_outputs)
        return None

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            max_tokens=self.max_tokens if self.max_tokens is not None else default_max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=-1 if self.top_k is None else self.top_k,
            seed=self.seed, stop=stop, stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=bool(self.ignore_eos),
            min_tokens=self.min_tokens or 0, logprobs=self.num_logprobs(), logit_bias=self._logit_bias(), structured=self.structured(),
            n=1 if self.n is None else self.n,
            **{name: getattr(self, name) for name in ("repetition_penalty", "presence_penalty", "frequency_penalty", "min_p")
               if getattr(self, name) is not None},
        )


def _schema_text(where: str, schema: Any) -> str:
    """A JSON Schema given as an object, or as JSON text (vLLM takes both), as JSON text."""
    if isinstance(schema, str):
        return schema
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"{where} must be a JSON Schema object, got {type(schema).__name__}")
    return json.dumps(schema)


def _response_format(value: dict[str, Any]) -> StructuredOutput | None:
    """OpenAI's response_format: {"type": "text"}, {"type": "json_object"} or
    {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}."""
    kind = value.get("type")
    extra = sorted(set(value) - {"type", "json_schema"})
    if extra:
        raise InvalidRequestError(f"response_format.{extra[0]} is not a field of response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind != "json_schema":
        raise InvalidRequestError(f"response_format.type must be one of text, json_object, json_schema; got {json.dumps(kind)[:80]}")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidRequestError("response_format.json_schema must be an object with the schema under \"schema\"")
    extra = sorted(set(spec) - {"name", "schema", "strict", "description"})
    if extra:
        raise InvalidRequestError(f"response_format.json_schema.{extra[0]} is not a field of json_schema")
    if "schema" not in spec:  # OpenAI's own: strict schemas are enforced, and a missing one allows any JSON object
        return StructuredOutput("json_object")
    return StructuredOutput("json", _schema_text("response_format.json_schema.schema", spec["schema"]))


STRUCTURED_OUTPUTS_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def _structured_outputs(value: dict[str, Any]) -> StructuredOutput | None:
    """vLLM's structured_outputs: exactly one of json (a schema, object or text), regex,
    choice (a list of strings), grammar (EBNF/GBNF or Lark) and json_object (true)."""
    unknown = sorted(k for k, v in value.items() if k not in STRUCTURED_OUTPUTS_KINDS and v not in (None, False))
    if unknown:
        raise InvalidRequestError(f"structured_outputs.{unknown[0]} is not supported: pdserve takes {', '.join(STRUCTURED_OUTPUTS_KINDS)}")
    given = [k for k in STRUCTURED_OUTPUTS_KINDS if value.get(k) not in (None, False)]
    if len(given) != 1:
        raise InvalidRequestError(f"structured_outputs takes exactly one of {', '.join(STRUCTURED_OUTPUTS_KINDS)}; got {len(given)}")
    kind = given[0]
    spec = value[kind]
    if kind == "json":
        return StructuredOutput("json", _schema_text("structured_outputs.json", spec))
    if kind == "json_object":
        if spec is not True:
            raise InvalidRequestError("structured_outputs.json_object must be true")
        return StructuredOutput("json_object")
    if kind == "choice":
        if not isinstance(spec, list) or not all(isinstance(c, str) for c in spec):
            raise InvalidRequestError("structured_outputs.choice must be a list of strings")
        return StructuredOutput("choice", choices=tuple(spec))
    if not isinstance(spec, str):
        raise InvalidRequestError(f"structured_outputs.{kind} must be a string")
    return StructuredOutput(kind, spec)


class CompletionRequest(_Common):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    echo: bool | None = None
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        return bad + [n for n, ok in (("echo", not self.echo), ("best_of", self.best_of in (None, 1)), ("suffix", not self.suffix)) if not ok]

    def num_logprobs(self) -> int | None:
        return self.logprobs


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown keys are refused by name (ChatMessageIn.unsupported)
    type: str
    text: str | None = None


class ChatMessageIn(BaseModel):
    # unknown fields (``name``, ``refusal``, ...) are refused by name, not dropped: none of
    # them reaches the chat template here
    model_config = ConfigDict(extra="allow")
    role: str
    content: Union[str, list[ContentPart], None] = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls (router/tool_calls.py)
    tool_call_id: str | None = None  # a tool message's: which call it answers

    def history(self, where: str) -> dict:
        """This message as chat templates take it (router/tool_calls.py history_message)."""
        return tool_calls.history_message(self.role, self.text(), self.tool_calls, self.tool_call_id, where)

    def unsupported(self, where: str) -> list[str]:
        """This message's fields that are set and not implemented, as ``where.field``
        (null or an empty list changes nothing)."""
        bad = [f"{where}.{k}" for k, v in (self.model_extra or {}).items() if v not in (None, [])]
        parts = self.content if isinstance(self.content, list) else []  # other types than text are refused by ``text()``
        return bad + [f"{where}.content[{i}].{k}" for i, part in enumerate(parts) if part.type == "text" for k in (part.model_extra or {})]

    def text(self) -> str:
        """Raises InvalidRequestError for a non-text part (images, audio, files)."""
        if isinstance(self.content, list):
            other = [p.type for p in self.content if p.type != "text" or p.text is None]
            if other:
                raise InvalidRequestError(f"message content of type {other[0]!r} is not supported: this model takes text only")
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Common):
    messages: list[ChatMessageIn]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None

    def tool_choice_(self) -> tool_calls.ToolChoice | None:
        """``tools``, ``tool_choice`` and ``parallel_tool_calls`` checked (None without tools)."""
        return tool_calls.parse_choice(self.tools, self.tool_choice, self.parallel_tool_calls)

    def unsupported(self) -> list[str]:
        return super().unsupported() + [k for i, m in enumerate(self.messages) for k in m.unsupported(f"messages[{i}]")]

    def num_logprobs(self) -> int | None:
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs: true")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}")
        return (self.top_logprobs or 0) if self.logprobs else None


def parse(model_cls: type[BaseModel], body: bytes) -> Any:
    """Parse a JSON body; raises InvalidRequestError naming the bad field."""
    try:
        request = model_cls.model_validate_json(body)
    except ValidationError as e:
        errors = e.errors()
        err, loc = errors[0], errors[0].get("loc", ())
        tag = next((i for i, p in enumerate(loc) if isinstance(p, str) and ("[" in p or p in ("str", "int", "float", "bool"))), None)
        if tag is not None:  # each member of a union refused it (pydantic tags the path with the member): say what the field takes
            kinds = dict.fromkeys(x["loc"][tag] for x in errors if len(x.get("loc", ())) > tag and x["loc"][:tag] == loc[:tag])
            where = ".".join(str(p) for p in loc[:tag]) or "body"
            raise InvalidRequestError(f"{where} must be one of: {', '.join(kinds)}; got {json.dumps(err.get('input'))[:80]}") from None
        where = ".".join(str(p) for p in loc) or "body"
        raise InvalidRequestError(f"{where}: {err.get('msg', 'invalid')}") from None
    bad = request.unsupported()
    if bad:
        raise InvalidRequestError(f"unsupported parameter(s) for pdserve: {', '.join(bad)}")
    if getattr(request, "stream_options", None) is not None and not request.stream:
        raise InvalidRequestError("stream_options is only allowed when stream is true (as OpenAI and vLLM refuse it)")
    return request


def completion_prompt(request: CompletionRequest) -> tuple[str | None, list[int] | None]:
    """(text, token ids): one of them. Raises InvalidRequestError for a batch of prompts."""
    p = request.prompt
    if isinstance(p, str):
        return p, None
    if not p:
        raise InvalidRequestError("prompt is empty: it must have at least 1 token")
    if p and all(isinstance(x, int) for x in p):
        return None, list(p)
    if len(p) == 1:
        return (p[0], None) if isinstance(p[0], str) else (None, list(p[0]))
    raise InvalidRequestError("prompt: send one prompt per request (a list of prompts is not supported)")


# -- responses ---------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


def completion_logprobs(tokenizer, logprobs: list, text_offset: int = 0) -> dict:
    """OpenAI's completions ``logprobs`` object for ``logprobs`` (pdserve.sampling.TokenLogprob), the first
    token at character ``text_offset`` of the choice's text."""
    tokens = [tokenizer.decode([lp.token_id]) for lp in logprobs]
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [{tokenizer.decode([t.token_id]): t.logprob for t in lp.top} for lp in logprobs],
        "text_offset": offsets,
    }


def chat_logprobs(tokenizer, logprobs: list) -> dict:
    """OpenAI's chat ``logprobs`` object ({"content": [...]}) for pdserve.sampling.TokenLogprob entries."""
    def entry(token_id: int, logprob: float) -> dict:
        token = tokenizer.decode([token_id])
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t.token_id, t.logprob) for t in lp.top]} for lp in logprobs]}


def completion_choice(index: int, text: str, finish_reason: str, logprobs: dict | None = None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_choice(index: int, text: str | None, finish_reason: str, logprobs: dict | None = None, calls: list[dict] | None = None) -> dict:
    """``calls``: the reply's tool calls (then ``text`` is the content beside them, or None)."""
    message = {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_response(rid: str, model: str, choices: list[dict], prompt_tokens: int, completion_tokens: int) -> dict:
    """``choices``: completion_choice's, by index; ``completion_tokens``: all choices'."""
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model, "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens)}


def chat_response(rid: str, model: str, choices: list[dict], prompt_tokens: int, completion_tokens: int) -> dict:
    """``choices``: chat_choice's, by index; ``completion_tokens``: all choices'."""
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model, "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens)}


def completion_chunk(rid: str, model: str, created: int, text: str, finish_reason: str | None, logprobs: dict | None = None,
                     index: int = 0) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}


def chat_chunk(rid: str, model: str, created: int, delta: dict, finish_reason: str | None, logprobs: dict | None = None,
               index: int = 0) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}


def usage_chunk(rid: str, model: str, created: int, obj: str, prompt_tokens: int, completion_tokens: int) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage(prompt_tokens, completion_tokens)}


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


# -- errors ---------------------------------------------------------------------------------

def error_status(exc: BaseException) -> tuple[int, str]:
    """(HTTP status, OpenAI error type) for an exception on the request path."""
    for cls, status, kind in (
        (RequestTooLargeError, 413, "invalid_request_error"),
        (InvalidRequestError, 400, "invalid_request_error"),
        (AuthenticationError, 401, "authentication_error"),
        (CapacityError, 429, "rate_limit_error"),
        (ShuttingDownError, 503, "service_unavailable"),
        (BackPressureError, 429, "rate_limit_error"),
        (KVIncompatibleError, 500, "server_error"),
        (KVAuthError, 500, "server_error"),
        (KVTransferError, 503, "service_unavailable"),
        (WorkerStalledError, 503, "service_unavailable"),  # every replica tried was stuck in a step
        (TimeoutError, 504, "timeout"),
    ):
        if isinstance(exc, cls):
            return status, kind
    return 500, "server_error"


# messages that do not start with their field: (prefix, the field; "" = the first name after the prefix)
_PARAM_OF_MESSAGE = (("unknown model", "model"), ("message role", "messages"), ("unsupported parameter(s) for pdserve:", ""))


def error_body(message: str, kind: str, status: int) -> dict:
    """OpenAI's error object. ``param`` is the request field the message starts with (as in
    "max_tokens must be >= 1, got 0" or "prompt must be one of: ..."), the field of a message in
    ``_PARAM_OF_MESSAGE`` (the first unsupported one of several), or None when it names none."""
    head = re.split(r"[\s.:]", message, maxsplit=1)[0]
    param = head if head in CompletionRequest.model_fields or head in ChatCompletionRequest.model_fields else None
    for prefix, field in _PARAM_OF_MESSAGE:
        if param is None and message.startswith(prefix):
            param = field or message[len(prefix):].split(",")[0].strip() or None
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}
