"""The log-probability types a stream carries: what the engine reports and the gRPC client
returns. No torch here, so the client SDK and the CLI import without it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


class TopLogprob(NamedTuple):
    token_id: int
    logprob: float


@dataclass
class TokenLogprob:
    """A sampled token's log-probability under the model (log_softmax of the raw logits,
    before temperature, top-k and top-p, as vLLM reports by default) and the ``top`` most
    likely tokens with theirs, most likely first."""

    token_id: int
    logprob: float
    top: list[TopLogprob] = field(default_factory=list)
