"""Conditional disaggregation: which pool prefills a request.

A request goes to the prefill pool (its KV then shipped to decode) unless the decode
replica can prefill it itself more cheaply, as NVIDIA Dynamo's and llm-d's routers decide
by prompt length and prefill queue state:

- its prompt is short (``router.local_prefill_max_tokens``): the hand-off's fixed cost
  (a second call, a KV fetch) outweighs one short prefill chunk in a decode step; or
- the prefill pool's queue would break the TTFT SLO: the tokens this router has in flight
  there, at the prefill rate it has measured, would wait longer than
  ``router.local_prefill_queue_s``, and this router has fewer than
  ``router.max_local_prefills`` local prefills running (decode has room).

The router decides alone, from what it has sent and seen: no call to a replica is on
the path. Decisions are counted (``stats``, and ``pdserve_prefill_placement_total``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

EWMA_WEIGHT = 0.2  # of the newest prefill's rate in the measured tokens/s


@dataclass
class PlacementStats:
    num_remote: int = 0
    num_local_short: int = 0  # prefilled on decode: a short prompt
    num_local_queued: int = 0  # prefilled on decode: the prefill queue would break the TTFT SLO


class PrefillPlacement:
    """``max_local_tokens``: prompts of at most this many tokens prefill on decode (0 = none).
    ``queue_s``: prefill on decode when the prefill pool's estimated wait exceeds this many
    seconds (None = never). ``max_local``: local prefills at once, at most."""

    def __init__(self, max_local_tokens: int = 0, queue_s: float | None = None, max_local: int = 1,
                 on_decision: Callable[[str], None] | None = None):
        self.max_local_tokens, self.queue_s, self.max_local = max_local_tokens, queue_s, max_local
        self.on_decision = on_decision or (lambda where: None)  # "remote" | "local_short" | "local_queued" (the metric)
        self.remote_tokens = 0  # prompt tokens this router has at the prefill pool now
        self.num_local_running = 0
        self.tokens_per_s: float | None = None  # prefill's measured rate (prompt tokens / s of a call), EWMA
        self.stats = PlacementStats()

    def prefill_wait_s(self) -> float:
        """Estimated seconds before a new prompt's prefill would start (0 before any measurement)."""
        return self.remote_tokens / self.tokens_per_s if self.tokens_per_s else 0.0

    def choose_local(self, num_prompt_tokens: int) -> bool:
        """True: the decode pool prefills this prompt; False: the prefill pool does. Call
        ``started_local``/``started_remote`` with the answer, then the matching ``finished``."""
        if num_prompt_tokens <= self.max_local_tokens:
            where = "local_short"
        elif self.queue_s is not None and self.num_local_running < self.max_local and self.prefill_wait_s() > self.queue_s:
            where = "local_queued"
        else:
            where = "remote"
        setattr(self.stats, f"num_{where}", getattr(self.stats, f"num_{where}") + 1)
        self.on_decision(where)
        return where != "remote"

    def started(self, local: bool, num_prompt_tokens: int) -> int:
        """Count a prefill that starts now; returns the prompt tokens already queued ahead of it."""
        if local:
            self.num_local_running += 1
            return 0
        ahead = self.remote_tokens
        self.remote_tokens += num_prompt_tokens
        return ahead

    def finished(self, local: bool, num_prompt_tokens: int, seconds: float | None = None, ahead: int = 0) -> None:
        """A prefill ended. ``seconds``: how long a remote one took (None if it failed or was
        cancelled); it updates the measured rate only if nothing was queued ahead of it
        (``ahead``, from ``started``), so the rate is prefill's own, not its queue's."""
        if local:
            self.num_local_running -= 1
            return
        self.remote_tokens -= num_prompt_tokens
        if seconds and seconds > 0 and ahead == 0:
            rate = num_prompt_tokens / seconds
            self.tokens_per_s = rate if self.tokens_per_s is None else (1 - EWMA_WEIGHT) * self.tokens_per_s + EWMA_WEIGHT * rate
