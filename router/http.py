"""The OpenAI-compatible HTTP API's request handling, for the router's FastAPI routes
(router/server.py): parse and validate (router/frontend.py's Frontend), run the request
(``generate``: the router's stream of ``Output``), answer in OpenAI's shapes
(router/openai_api.py), streamed as server-sent events or whole."""

import asyncio
import logging
import math
import time
from typing import Any, AsyncIterator, Callable

from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdserve.errors import InvalidRequestError
from pdserve.sampling import SamplingParams
from router import openai_api as oa
from router import tool_calls
from router.disconnect import Receive
from router.errors import error_message, retry_after_s
from router.frontend import Frontend, Output

Generate = Callable[..., AsyncIterator[Output]]  # (prompt ids, params, *, receive=): the router's generate

log = logging.getLogger(__name__)

CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left before its answer (Ray Serve's proxy logs it too)


def parse(frontend: Frontend, body: bytes, chat: bool) -> tuple[Any, list[int], SamplingParams]:
    """(the OpenAI request, prompt ids, sampling parameters); raises InvalidRequestError."""
    if chat:
        req = oa.parse(oa.ChatCompletionRequest, body)
        frontend.check_model(req.model)
        choice = req.tool_choice_()
        prompt_ids = frontend.chat_ids([m.history(f"messages[{i}]") for i, m in enumerate(req.messages)], choice.tools if choice else None)
        if req.max_completion_tokens is not None:
            req.max_tokens = req.max_completion_tokens
        params = req.sampling_params(default_max_tokens=max(1, frontend.max_model_len - len(prompt_ids)))
        constraint = choice.constraint(frontend.tool_parser) if choice else None
        if constraint is not None:  # required, or a named function: the calls always parse
            if params.structured is not None:
                raise InvalidRequestError("tool_choice required or naming a function constrains the output itself: "
                                          "leave out response_format and structured_outputs")
            params.structured = constraint
    else:
        req = oa.parse(oa.CompletionRequest, body)
        frontend.check_model(req.model)
        text, ids = oa.completion_prompt(req)
        if ids is not None:
            frontend.check_token_ids("prompt", ids)
        prompt_ids = ids if ids is not None else frontend.text_ids(text)
        params = req.sampling_params(default_max_tokens=16)
    frontend.validate(prompt_ids, params)
    return req, prompt_ids, params


async def handle(frontend: Frontend, generate: Generate, body: bytes, chat: bool, receive: Receive | None = None):
    """One OpenAI request: errors before the first token get their HTTP status and
    OpenAI's error shape; a stream that fails later ends with an error event. With the
    request's ASGI ``receive``, a client that disconnects stops its request at once
    (router/disconnect.py)."""
    rid = oa.new_id("chatcmpl" if chat else "cmpl")
    try:
        req, prompt_ids, params = await asyncio.to_thread(parse, frontend, body, chat)  # tokenizing stays off the event loop
        stream = generate(prompt_ids, params, receive=receive)  # stops if the client leaves
        first = await stream.__anext__()
    except StopAsyncIteration:  # the client left before the first token: nobody reads this
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    except Exception as e:  # noqa: BLE001 - every error gets a status and a message
        return error_response(e)
    choice = req.tool_choice_() if chat else None
    choice = choice if choice is not None and choice.mode != "none" else None  # "none": the text as it is
    names = {f["name"] for f in choice.functions} if choice else set()
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        calls = [tool_calls.CallStream(frontend.tool_parser, names, choice.mode != "auto") for _ in range(params.n)] if choice else None
        sse = sse_stream(frontend, rid, chat, first, stream, include_usage, params.logprobs is not None, calls, params.n)
        return StreamingResponse(sse, media_type="text/event-stream")
    texts, reasons, logprobs, last = [""] * params.n, [None] * params.n, [[] for _ in range(params.n)], first
    try:
        chunk = first
        while True:
            texts[chunk.index] += chunk.text
            reasons[chunk.index] = chunk.finish_reason or reasons[chunk.index]
            logprobs[chunk.index].extend(chunk.logprobs)
            last = chunk
            chunk = await stream.__anext__()
    except StopAsyncIteration:
        pass
    except Exception as e:  # noqa: BLE001
        return error_response(e)
    finally:
        await stream.aclose()
    if not all(reasons):  # the client left mid-answer: nobody reads this
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    choices = []
    for i, (text, reason, lps) in enumerate(zip(texts, reasons, logprobs)):
        lp = None
        if params.logprobs is not None:
            lp = oa.chat_logprobs(frontend.tokenizer, lps) if chat else oa.completion_logprobs(frontend.tokenizer, lps)
        if not chat:
            choices.append(oa.completion_choice(i, text, reason, lp))
            continue
        parsed = tool_calls.parse_calls(text, frontend.tool_parser, names) if choice else None
        if parsed is not None:  # text that does not parse as calls stays content
            content, calls = parsed
            choices.append(oa.chat_choice(i, content, "tool_calls", lp, calls))
        else:
            choices.append(oa.chat_choice(i, text, reason, lp))
    build = oa.chat_response if chat else oa.completion_response
    return build(rid, frontend.model_name, choices, last.prompt_tokens, last.completion_tokens)


async def sse_stream(frontend: Frontend, rid: str, chat: bool, first: Output, stream: AsyncIterator[Output], include_usage: bool,
                     with_logprobs: bool, calls: list[tool_calls.CallStream] | None = None, n: int = 1):
    """The SSE events of one streamed request of ``n`` choices, each event one choice's by its
    index. ``calls`` (chat with tools, one per choice): content that may begin a tool call is
    held back, and the calls go out at the end as ``delta.tool_calls``."""
    created, last, offsets, open_choices = int(time.time()), first, [0] * n, n
    try:
        if chat:
            for i in range(n):
                yield oa.sse(oa.chat_chunk(rid, frontend.model_name, created, {"role": "assistant", "content": ""}, None, index=i))
        chunk = first
        while True:
            reason, i = chunk.finish_reason or None, chunk.index
            if chat:
                text = calls[i].push(chunk.text) if calls is not None else chunk.text
                found = []
                if reason and calls is not None:
                    rest, found = calls[i].finish()
                    text += rest
                delta = {"content": text} if text else {}
                lp = oa.chat_logprobs(frontend.tokenizer, chunk.logprobs) if with_logprobs else None
                if found:  # the content first, then the calls with the finish reason
                    if delta or lp:
                        yield oa.sse(oa.chat_chunk(rid, frontend.model_name, created, delta, None, lp, i))
                    delta, lp, reason = {"tool_calls": [{"index": k, **call} for k, call in enumerate(found)]}, None, "tool_calls"
                yield oa.sse(oa.chat_chunk(rid, frontend.model_name, created, delta, reason, lp, i))
            else:
                lp = oa.completion_logprobs(frontend.tokenizer, chunk.logprobs, offsets[i]) if with_logprobs else None
                offsets[i] += sum(len(t) for t in lp["tokens"]) if lp else 0
                yield oa.sse(oa.completion_chunk(rid, frontend.model_name, created, chunk.text, reason, lp, i))
            last = chunk
            open_choices -= reason is not None
            if not open_choices:
                break
            try:
                chunk = await stream.__anext__()
            except StopAsyncIteration:  # the client left: nobody reads the rest
                return
        if include_usage:
            obj = "chat.completion.chunk" if chat else "text_completion"
            yield oa.sse(oa.usage_chunk(rid, frontend.model_name, created, obj, last.prompt_tokens, last.completion_tokens))
    except Exception as e:  # noqa: BLE001 - headers are sent: report in the stream
        status, kind = oa.error_status(e)
        yield oa.sse(oa.error_body(error_message(e), kind, status))
    finally:
        await stream.aclose()
    yield oa.sse("[DONE]")


def error_response(exc: BaseException, default_retry_after_s: float = 1.0) -> JSONResponse:
    """OpenAI's error shape with the status for ``exc``; a 429 or 503 (shutting down) carries ``Retry-After`` (seconds)."""
    status, kind = oa.error_status(exc)
    if status == 500:
        log.error("request failed", exc_info=exc)
    hint = retry_after_s(exc, default_retry_after_s)
    headers = {"Retry-After": str(max(1, math.ceil(hint)))} if hint is not None else None
    return JSONResponse(oa.error_body(error_message(exc), kind, status), status_code=status, headers=headers)
