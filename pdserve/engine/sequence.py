"""Sequence: one request's tokens and KV bookkeeping inside an engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any

from pdserve.sampling import FirstToken, SamplingParams, TokenLogprob


class SeqStatus(Enum):
    WAITING = auto()  # not scheduled yet, or preempted (recomputes from scratch)
    RUNNING = auto()  # holds blocks and is scheduled every step
    FINISHED = auto()


@dataclass(eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]  # prompt followed by generated tokens
    num_prompt_tokens: int
    params: SamplingParams
    # Prefill workers stop after the first token and keep the KV for hand-off.
    stop_after_first_token: bool = False
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_tokens: int = 0  # of those, found in the prefix cache
    block_table: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    num_preemptions: int = 0
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per generated token, when params.logprobs is set
    # layer-wise streaming (kv_transfer/progress.py LayerProgress): told as each layer's KV is
    # written, and before the blocks are freed under a reader
    kv_progress: Any = None
    # params.structured's llguidance matcher (Engine.prepare), in the state after the output so far
    grammar: Any = None
    index: int = 0  # which choice of its request this is (params.n > 1 runs one sequence per choice)
    # params.n > 1, at its first token: every choice's first token (Engine: it stops there and
    # keeps its blocks, which its worker forks or hands off)
    choices: list[FirstToken] | None = None
    # what this sequence's KV depends on beyond its tokens, salted into its prefix-cache hashes
    # (longrope's long table: Engine.switch_rope_tables)
    kv_salt: bytes | None = None
    # leading blocks of block_table given back: wholly before the sliding window of every token
    # still to come (Engine.free_outside_window); their ids stay in the table, unread
    num_dead_blocks: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens
