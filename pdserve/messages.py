"""Typed messages between the router and the worker pools (carried by Ray Serve handles)."""

from __future__ import annotations

from dataclasses import dataclass

from kv_transfer.base import KVHandle
from pdserve.sampling import SamplingParams, TokenLogprob


@dataclass
class PrefillRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


@dataclass
class PrefillStarted:
    """Layer-wise hand-off (kv_transfer.layerwise): the prompt is being prefilled now and its
    KV can be fetched from ``kv`` as each layer is written; the PrefillResult follows."""

    request_id: str
    kv: KVHandle


@dataclass
class PrefillResult:
    """The first token, and where its prompt's KV waits (None once finished)."""

    request_id: str
    first_token: int
    finish_reason: str | None  # "stop" / "length" if the first token ends the request
    kv: KVHandle | None
    first_logprob: TokenLogprob | None = None  # when params.logprobs is set


@dataclass
class DecodeRequest:
    """Disaggregated: the first token and the KV handle from prefill; layer-wise, only the
    handle (``first_token`` None: it arrives with the KV, after its last layer). Colocated (or any
    worker asked to do it all): both None, and the worker prefills and samples token 1 itself.
    Migrated (its decode replica died mid-stream): ``first_token`` and ``resume_ids`` are the
    tokens already streamed, ``kv`` None; the worker recomputes their KV and goes on after them."""

    request_id: str
    prompt_ids: list[int]
    first_token: int | None  # sampled by prefill; decode continues after it (None: comes with layer-wise KV)
    params: SamplingParams
    kv: KVHandle | None
    resume_ids: tuple[int, ...] = ()  # migration: tokens generated after first_token, already streamed


@dataclass
class TokenChunk:
    """Tokens streamed from decode: token_ids excludes a stop token that ended the request."""

    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token in token_ids, when params.logprobs is set
