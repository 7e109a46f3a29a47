"""Sampling parameters, their validation, the one-row sampling reference and stop checks.

Shared by the prefill worker (which samples the first token) and the decode
worker (which samples the rest), so both apply exactly the same rules. The engine samples
a whole step at once (pdserve/engine/sampler.py); ``sample``, ``apply_penalties`` and
``token_logprob`` here are the same rules one row at a time, the reference its tests
compare it with.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field

import torch

from pdserve.errors import InvalidRequestError
from pdserve.logprobs import TokenLogprob, TopLogprob
from pdserve.structured import StructuredOutput

# Temperatures below this sample greedily, as vLLM's _SAMPLING_EPS (1e-5) does.
GREEDY_BELOW_TEMPERATURE = 1e-5
MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20
MAX_STOP_STRING_CHARS = 256
MAX_ADDITIVE_PENALTY = 2.0  # presence/frequency penalties in [-2, 2], as OpenAI and vLLM allow
MAX_LOGIT_BIAS = 100.0  # |bias| at most this, as OpenAI allows (vLLM's OpenAI server clamps to it)
MAX_CHOICES = 64  # n at most this (each choice is a sequence in decode's batch)


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    max_tokens: tokens to generate (>= 1). temperature: 0 means greedy.
    top_p in (0, 1]; top_k <= 0 disables it. seed: per-request random stream,
    so the same seed gives the same tokens whatever else runs beside it.
    stop_token_ids: tokens that end generation (finish_reason "stop"), besides
    EOS unless ignore_eos.

    Penalties, with vLLM's semantics (vllm/model_executor/layers/utils.py
    ``apply_penalties``; the OpenAI API reference for the two additive ones), applied to
    the raw logits before min_tokens' bans are lifted, temperature, top-k and top-p, and
    before a greedy argmax too:
    repetition_penalty (> 0, 1 = off): a token seen in the prompt or the output has its
    logit divided by it when positive, multiplied by it otherwise.
    frequency_penalty ([-2, 2], 0 = off): minus this times the token's count in the output.
    presence_penalty ([-2, 2], 0 = off): minus this once for a token in the output.
    Reported logprobs stay those of the raw logits, as vLLM reports by default.

    logit_bias ({token id: bias}, |bias| <= 100): added to the raw logits before the
    penalties, so it moves a greedy argmax too (vLLM v1's order: ``vllm/v1/sample/sampler.py``).
    min_p ([0, 1], 0 = off): after temperature, a token whose probability is below min_p times
    the most likely token's is dropped, before top-k and top-p (vLLM's ``MinPLogitsProcessor``);
    greedy ignores it, as it cannot change the argmax.
    structured (pdserve/structured.py): the output follows a JSON schema, regex, choice or
    grammar; the engine sets the tokens its grammar disallows to -inf before all of the above
    (logprobs included, as vLLM masks them).

    n (1-64): choices of one prompt. The prompt is prefilled once; choice ``i`` then runs as
    the request with ``fork(i)``'s parameters would alone (seed + i, as vLLM's
    ``ParentRequest`` gives its children), its KV blocks forked from the prompt's.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    min_tokens: int = 0
    stop: tuple[str, ...] = field(default_factory=tuple)
    logprobs: int | None = None  # return each sampled token's log-probability and this many top alternatives
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_p: float = 0.0
    structured: StructuredOutput | None = None  # constrain the output (pdserve/structured.py)
    n: int = 1  # choices of this prompt (``fork``)

    def fork(self, index: int) -> SamplingParams:
        """Choice ``index``'s parameters: n = 1 and, with a seed, seed + index (vLLM v1's
        ``ParentRequest._get_child_sampling_params``); the same object where n is already 1."""
        if self.n == 1:
            return self
        return dataclasses.replace(self, n=1, seed=None if self.seed is None else self.seed + index)

    @functools.cached_property
    def logit_bias_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """logit_bias as (ids [n] int64, biases [n] float32), built once per request, not per step."""
        return (torch.tensor(list(self.logit_bias), dtype=torch.long), torch.tensor(list(self.logit_bias.values()), dtype=torch.float32))

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def validate(self, num_prompt_tokens: int, max_model_len: int, vocab_size: int | None = None) -> None:
        """Raise InvalidRequestError naming the first bad field.

        The router and both workers call this with the same max_model_len and vocab_size
        (logits per row; None skips the logit_bias ids' upper bound), so a request the router
        accepts is never refused later.
        """
        if num_prompt_tokens < 1:
            raise InvalidRequestError("prompt is empty: it must have at least 1 token")
        if self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if num_prompt_tokens + self.max_tokens > max_model_len:
            raise InvalidRequestError(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({self.max_tokens}) = "
                f"{num_prompt_tokens + self.max_tokens} exceeds the model's context of {max_model_len} tokens"
            )
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequestError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise InvalidRequestError(f"top_k must be -1 (off), 0 (off) or positive, got {self.top_k}")
        if not isinstance(self.n, int) or not 1 <= self.n <= MAX_CHOICES:
            raise InvalidRequestError(f"n must be in [1, {MAX_CHOICES}], got {self.n}")
        if self.seed is not None and not 0 <= self.seed <= 2**63 - self.n:  # gRPC's int64 field holds the same range
            raise InvalidRequestError(f"seed must be in [0, 2**63 - n] (choice i takes seed + i), got {self.seed}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise InvalidRequestError(f"repetition_penalty must be a finite number > 0 (1 = off), got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_ADDITIVE_PENALTY <= getattr(self, name) <= MAX_ADDITIVE_PENALTY:  # NaN fails too
                raise InvalidRequestError(f"{name} must be in [-2, 2] (0 = off), got {getattr(self, name)}")
        if not (math.isfinite(self.min_p) and 0 <= self.min_p <= 1):
            raise InvalidRequestError(f"min_p must be in [0, 1] (0 = off), got {self.min_p}")
        for token, bias in self.logit_bias.items():
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                raise InvalidRequestError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
            if vocab_size is not None and token >= vocab_size:
                raise InvalidRequestError(f"logit_bias has {token}, outside the vocabulary of {vocab_size}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:  # NaN fails too
                raise InvalidRequestError(f"logit_bias[{token}] must be in [-100, 100], got {bias}")
        if self.structured is not None:
            self.structured.validate()
        if len(self.stop) > MAX_STOP_STRINGS or any(not s or len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            raise InvalidRequestError(f"stop takes at most {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_STRING_CHARS} characters")


def apply_penalties(logits: torch.Tensor, params: SamplingParams, token_ids: list[int], num_prompt_tokens: int) -> torch.Tensor:
    """``logits: [vocab]`` with ``params``' penalties applied (a new tensor, float32), as vLLM's
    ``apply_penalties`` computes them: the repetition penalty over the tokens of the prompt
    and the output, then ``- frequency * count - presence * (count > 0)`` over the output's.

    token_ids: the sequence so far, prompt first; its first ``num_prompt_tokens`` are the
    prompt, the rest the output (a migrated request keeps that split, so its penalties match).
    """
    vocab = logits.shape[-1]
    logits = logits.float().clone()
    ids = torch.tensor(token_ids, dtype=torch.long)
    output_counts = torch.bincount(ids[num_prompt_tokens:], minlength=vocab)[:vocab]  # [vocab]
    output_seen = output_counts > 0
    if params.repetition_penalty != 1.0:
        seen = output_seen.clone()
        seen[ids[:num_prompt_tokens]] = True
        penalty = torch.where(seen, params.repetition_penalty, 1.0)
        logits *= torch.where(logits > 0, 1.0 / penalty, penalty)  # vLLM's apply_repetition_penalties_torch
    if params.frequency_penalty != 0.0:
        logits -= params.frequency_penalty * output_counts
    if params.presence_penalty != 0.0:
        logits -= params.presence_penalty * output_seen
    return logits


def sample(logits: torch.Tensor, params: SamplingParams, position: int, num_generated: int = 0,
           eos_token_ids: frozenset[int] = frozenset(), token_ids: list[int] | None = None, num_prompt_tokens: int = 0) -> int:
    """Pick one token id from ``logits: [vocab]``.

    position: index of the token being sampled in the whole sequence; with a
    seed, the random stream is keyed by (seed, position), so the choice does
    not depend on batching or on which worker samples it. num_generated: tokens
    generated before this one; below ``params.min_tokens`` EOS (``eos_token_ids``,
    unless ignore_eos) and the stop tokens cannot be picked. token_ids /
    num_prompt_tokens: the sequence so far and its prompt's length, which the penalties
    read (``apply_penalties``); needed only when ``params.has_penalties``.
    Order as vLLM v1's sampler: logit bias, penalties, min_tokens' bans, then greedy argmax or
    temperature, min-p, top-k, top-p and a draw.
    """
    if params.logit_bias:
        ids, biases = params.logit_bias_tensors
        logits = logits.float().clone()
        logits[ids] += biases
    if params.has_penalties:
        if token_ids is None:
            raise ValueError("penalties need the sequence's token_ids")
        logits = apply_penalties(logits, params, token_ids, num_prompt_tokens)
    if num_generated < params.min_tokens:
        banned = [*params.stop_token_ids, *([] if params.ignore_eos else eos_token_ids)]
        if banned:
            unbanned, logits = logits, logits.clone()
            logits[torch.tensor(banned, dtype=torch.long)] = -math.inf
            if not torch.isfinite(logits).any():  # a grammar's mask allows only these: it ends the output
                logits = unbanned
    if params.temperature < GREEDY_BELOW_TEMPERATURE:  # 0, or so small that logits/T overflows
        return int(torch.argmax(logits))
    logits = logits.float() / params.temperature
    if params.min_p > 0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), -math.inf)
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, -math.inf)
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = torch.sort(probs, descending=True)
        outside = torch.cumsum(sorted_probs, dim=-1) - sorted_probs > params.top_p
        sorted_probs[outside] = 0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    generator = None
    if params.seed is not None:
        generator = torch.Generator().manual_seed((params.seed * 1_000_003 + position) % (1 << 63))
    return int(torch.multinomial(probs, 1, generator=generator))


def token_logprob(logits: torch.Tensor, token_id: int, num_top: int) -> TokenLogprob:
    """logits: [vocab] of the step that sampled ``token_id``."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    top = torch.topk(logprobs, num_top) if num_top > 0 else None
    pairs = [TopLogprob(i, v) for i, v in zip(top.indices.tolist(), top.values.tolist())] if top is not None else []
    return TokenLogprob(token_id, float(logprobs[token_id]), pairs)


def finish_reason(token_id: int, num_generated: int, params: SamplingParams, eos_token_ids: frozenset[int]) -> str | None:
    """Return "stop", "length" or None after ``token_id`` became generated token number ``num_generated`` (1-based)."""
    stops = token_id in params.stop_token_ids or (not params.ignore_eos and token_id in eos_token_ids)
    if stops and num_generated > params.min_tokens:  # (sample() keeps them out before that)
        return "stop"
    if num_generated >= params.max_tokens:
        return "length"
    return None


@dataclass
class FirstToken:
    """Choice ``index`` of an n > 1 request at its first token, sampled with ``fork(index)``
    from the prompt's last logits; ``finish_reason`` set if that token ends it."""

    index: int
    token_id: int
    finish_reason: str | None
    logprob: TokenLogprob | None = None
