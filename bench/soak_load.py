"""The soak's requests (bench/soak.py): one client call each, over gRPC (the SDK) or HTTP
(OpenAI ``/v1/completions``), streamed or not, perhaps cancelled at a stage, and its outcome.

Every request is greedy with ``ignore_eos``, so its answer is fixed: a request whose prompt
is one of the reference prompts must equal that prompt's reference answer exactly (token ids
over gRPC, text over HTTP), and any other must have exactly ``max_tokens`` tokens.

Outcomes: ``ok``, ``wrong`` (a finished answer that differs), ``cancelled`` (the client left
on purpose), ``error:<status>`` (an explicit error: a gRPC status or an HTTP status, with a
message; or ``HTTP stream cut``, a chunked body that ended without its last chunk, as Ray
Serve's proxy ends a stream whose router replica died: aiohttp's ClientPayloadError,
httpx's RemoteProtocolError, an error in every HTTP client), ``lost`` (no answer and no
error before the client's deadline, or a stream that ended with neither a finish nor an
error).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import aiohttp
import grpc

CANCEL_STAGES = ("before", "first", "mid")  # before the first token; right after it; after a few


@dataclass
class Spec:
    prompt_ids: list[int]
    max_tokens: int
    api: str  # "grpc" | "http"
    stream: bool
    cancel: str | None  # a CANCEL_STAGES stage, or None
    reference: tuple[list[int], str] | None = None  # (token ids, text) the answer must equal


@dataclass
class Outcome:
    kind: str  # ok | wrong | cancelled | error:<status> | lost
    ttft_s: float | None = None
    tpot_s: float | None = None
    detail: str = ""


@dataclass
class Answer:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    num_tokens: int = 0
    finished: bool = False
    first_at: float | None = None


def draw(rng: random.Random, references: list[tuple[list[int], int, list[int], str]], cancel_share: float) -> Spec:
    """A random request: half of them a reference prompt, the rest a fresh one of 20-200
    tokens and 8-64 output tokens; either API, streamed or not; ``cancel_share`` of them
    cancelled at a random stage (a non-streamed one only before its answer)."""
    api, stream = rng.choice(("grpc", "http")), rng.random() < 0.5
    cancel = rng.choice(CANCEL_STAGES if stream else ("before",)) if rng.random() < cancel_share else None
    if references and rng.random() < 0.5:
        prompt, max_tokens, ids, text = rng.choice(references)
        return Spec(prompt, max_tokens, api, stream, cancel, (ids, text))
    prompt = [rng.randrange(1000, 30000) for _ in range(rng.randint(20, 200))]
    return Spec(prompt, rng.randint(8, 64), api, stream, cancel)


def judge(spec: Spec, answer: Answer, start: float, end: float) -> Outcome:
    ttft = answer.first_at - start if answer.first_at is not None else None
    tpot = (end - answer.first_at) / (answer.num_tokens - 1) if answer.first_at is not None and answer.num_tokens > 1 else None
    if not answer.finished:
        return Outcome("lost", detail="the stream ended with neither a finish nor an error")
    if spec.reference is not None:
        right = answer.token_ids == spec.reference[0] if spec.api == "grpc" else answer.text == spec.reference[1]
    else:
        right = answer.num_tokens == spec.max_tokens
    return Outcome("ok" if right else "wrong", ttft, tpot, "" if right else f"{answer.num_tokens} tokens")


class Caller:
    """Sends Specs to one cluster: ``grpc_client`` an AsyncClient (retries=0), ``http`` an
    aiohttp session, ``base_url`` its ``/v1`` URL, ``model`` the served name."""

    def __init__(self, grpc_client, http, base_url: str, model: str, deadline_s: float):
        self.grpc, self.http, self.base_url, self.model, self.deadline_s = grpc_client, http, base_url, model, deadline_s

    async def call(self, spec: Spec, rng: random.Random) -> Outcome:
        start, answer = time.perf_counter(), Answer()
        send = self._grpc(spec, answer, rng) if spec.api == "grpc" else self._http(spec, answer, rng)
        try:
            cancelled = await asyncio.wait_for(send, self.deadline_s)
        except asyncio.TimeoutError:
            return Outcome("lost", detail=f"no answer or error within {self.deadline_s:g} s")
        except grpc.RpcError as e:
            code = e.code().name if e.code() is not None else "UNKNOWN"
            return Outcome(f"error:{code}", detail=(e.details() or "")[:200])
        except HttpError as e:
            return Outcome(f"error:HTTP {e.status}", detail=e.message[:200])
        except aiohttp.ClientPayloadError as e:  # the chunked body ended without its last chunk: every HTTP client raises on it
            return Outcome("error:HTTP stream cut", detail=f"{type(e).__name__}: {e}"[:200])
        except Exception as e:  # noqa: BLE001 - a connection dropped with no status: nothing explicit reached the client
            return Outcome("lost", detail=f"{type(e).__name__}: {e}"[:200])
        return Outcome("cancelled") if cancelled else judge(spec, answer, start, time.perf_counter())

    def _tokens_before_cancel(self, spec: Spec, rng: random.Random) -> int:
        return {"first": 1, "mid": rng.randint(2, max(2, spec.max_tokens // 2))}.get(spec.cancel, 0)

    async def _grpc(self, spec: Spec, answer: Answer, rng: random.Random) -> bool:
        """Returns whether the client cancelled; raises grpc.RpcError for an error status."""
        kwargs = {"prompt_token_ids": spec.prompt_ids, "max_tokens": spec.max_tokens, "ignore_eos": True, "timeout_s": self.deadline_s}
        if not spec.stream:
            call = asyncio.ensure_future(self.grpc.generate(**kwargs))
            if spec.cancel == "before" and not await _left_before(call, rng):
                return True
            result = await call
            answer.token_ids, answer.text, answer.num_tokens = result.token_ids, result.text, len(result.token_ids)
            answer.finished, answer.first_at = bool(result.finish_reason), time.perf_counter()
            return False
        stream, stop_after = self.grpc.stream(**kwargs), self._tokens_before_cancel(spec, rng)
        if spec.cancel == "before":
            await asyncio.sleep(rng.uniform(0, 0.05))
            stream.cancel()
        async for chunk in stream:
            if chunk.token_ids and answer.first_at is None:
                answer.first_at = time.perf_counter()
            answer.token_ids += chunk.token_ids
            answer.text += chunk.text
            answer.num_tokens = len(answer.token_ids)
            answer.finished = answer.finished or bool(chunk.finish_reason)
            if spec.cancel and answer.num_tokens >= stop_after and not answer.finished:
                stream.cancel()
                return True
        return spec.cancel == "before"

    async def _http(self, spec: Spec, answer: Answer, rng: random.Random) -> bool:
        body = {"model": self.model, "prompt": spec.prompt_ids, "max_tokens": spec.max_tokens, "temperature": 0.0,
                "ignore_eos": True, "stream": spec.stream, **({"stream_options": {"include_usage": True}} if spec.stream else {})}
        call = asyncio.ensure_future(self._post(body, spec, answer, rng))
        if spec.cancel == "before" and not await _left_before(call, rng):
            return True
        return await call

    async def _post(self, body: dict, spec: Spec, answer: Answer, rng: random.Random) -> bool:
        async with self.http.post(f"{self.base_url}/completions", json=body) as response:
            if response.status != 200:
                raise HttpError(response.status, await response.text())
            if not spec.stream:
                data = await response.json()
                answer.text, answer.num_tokens = data["choices"][0]["text"], data["usage"]["completion_tokens"]
                answer.finished, answer.first_at = bool(data["choices"][0].get("finish_reason")), time.perf_counter()
                return False
            stop_after, events = self._tokens_before_cancel(spec, rng), 0
            async for raw in response.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                payload = json.loads(line[5:])
                if "error" in payload:
                    raise HttpError(payload["error"].get("code") or 500, str(payload["error"].get("message")))
                if payload.get("usage"):
                    answer.num_tokens = payload["usage"]["completion_tokens"]
                for choice in payload.get("choices") or ():
                    if choice.get("text"):
                        answer.first_at = answer.first_at or time.perf_counter()
                        answer.text += choice["text"]
                        events += 1
                    answer.finished = answer.finished or bool(choice.get("finish_reason"))
                if spec.cancel and events >= stop_after and not answer.finished:
                    return True  # leaving the block closes the connection: the client left
            return False


class HttpError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status, self.message = status, message


async def _left_before(call: asyncio.Future, rng: random.Random) -> bool:
    """Give ``call`` 0-300 ms, then cancel it if it has not answered. Returns whether it had."""
    done, _ = await asyncio.wait({call}, timeout=rng.uniform(0, 0.3))
    if done:
        return True
    call.cancel()
    try:
        await call
    except (asyncio.CancelledError, Exception):  # noqa: BLE001 - it was cancelled; whatever it raised is moot
        pass
    return False
