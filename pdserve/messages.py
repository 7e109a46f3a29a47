"""Typed messages between the router and the worker pools (carried by Ray Serve handles),
and the KV handle they pass along: both pools and the router import them, and kv_transfer/
builds on them, not the other way round."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.callers import Caller
from pdserve.sampling import FirstToken, SamplingParams, TokenLogprob


@dataclass(frozen=True)
class KVHandle:
    """Where one prompt's KV can be fetched from. Passed prefill -> router -> decode."""

    backend: str  # the sender's configured backend: "grpc", "shm", "auto" or "loopback"
    address: str  # "host:port" of the sender's KV server ("loopback:<id>" in-process)
    transfer_id: str
    num_tokens: int  # prompt tokens covered by the KV
    node_id: str = ""  # the sender's node; shm needs the receiver on the same one
    shm_path: str = ""  # the sender's shared-memory KV pool, where it offers shm
    instance_id: str = ""  # the sender process; a restart changes it (new handshake)
    cuda_ipc: bool = False  # the sender's pool is on a GPU and exportable over CUDA IPC


@dataclass
class PrefillRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    caller: Caller | None = None  # the router replica that sent it (pdserve/callers.py)


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
    # params.n > 1: each choice's first token (choice 0's is first_token); ``kv`` is set while
    # one of them goes on, finish_reason when all have ended
    choices: tuple[FirstToken, ...] = ()


@dataclass(frozen=True)
class ChoiceState:
    """One choice of an n > 1 request on its way to decode: its index and the tokens the client
    has of it (WithKV: its first token; Migrated: all streamed so far)."""

    index: int
    streamed: tuple[int, ...]


@dataclass
class _DecodeCall:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    caller: Caller | None = field(default=None, kw_only=True)  # the router replica that sent it (pdserve/callers.py)
    # params.n > 1: the choices still to decode (FreshRequest: none, decode prefills the prompt
    # and forks it into all n); decode streams each one's tokens with its index
    choices: tuple[ChoiceState, ...] = field(default=(), kw_only=True)


@dataclass
class FreshRequest(_DecodeCall):
    """Decode prefills the prompt itself, first token included (colocated, or prefilled on
    decode by choice: router/placement.py)."""


@dataclass
class WithKV(_DecodeCall):
    """Prefill computed the prompt's KV (held at ``kv``) and sampled ``first_token``; decode
    fetches the KV and goes on after that token."""

    first_token: int
    kv: KVHandle


@dataclass
class LayerwiseKV(_DecodeCall):
    """Prefill is computing the prompt's KV now (``kv.layerwise``): decode fetches each layer
    as it is done, and the first token comes with the last one."""

    kv: KVHandle


@dataclass
class Migrated(_DecodeCall):
    """The request's decode replica died mid-stream: decode recomputes the prompt and
    ``streamed`` (every token the client has, at least one) and goes on after them."""

    streamed: tuple[int, ...]


DecodeRequest = FreshRequest | WithKV | LayerwiseKV | Migrated  # what the decode pool's generate takes


ALL_CHOICES = -1  # a TokenChunk index: the chunk ends every choice of its request (an abort)


@dataclass
class TokenChunk:
    """Tokens streamed from decode: token_ids excludes a stop token that ended the request
    (with n > 1: the choice ``index``)."""

    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token in token_ids, when params.logprobs is set
    index: int = 0  # which choice (params.n > 1), or ALL_CHOICES
