"""The step's sampler: every draw of a step in one batch of tensor ops on the logits' device.

``sample_batch(logits, draws)`` takes the step's logits ``[rows, vocab]`` where the model left
them (a GPU's memory, or the CPU) and a ``Draw`` per token to pick (a sequence's next token;
an n > 1 prompt has n draws over one row). Only the picked ids and the requested logprobs
cross to the host, in one copy each.

The rules are ``pdserve.sampling.sample``'s, the one-row reference, in vLLM v1's order
(``vllm/v1/sample/sampler.py``): a grammar's bitmask (also in the logprobs), logit bias,
penalties (``sampling.apply_penalties``), min_tokens' bans, then greedy argmax, or
temperature, min-p, top-k, top-p and a draw. Each step is one op over the rows that need it,
so the number of ops does not grow with the batch. Greedy ids equal the reference's: the
same float32 ops, element by element, and an argmax that keeps the first maximum.

The draw is the exponential race (as vLLM's ``random_sample``): the token is
``argmax(p / q)`` with ``q ~ Exp(1)`` per vocabulary entry, which picks token t with
probability p_t. A seeded row's q comes from its own generator on the logits' device, seeded
by (seed, position) as the reference's is: the same seed and position give the same token
alone or in any batch, on one device kind. Where tokens of exactly equal probability straddle
a top-p cut-off, which of them stay is the order ``torch.topk`` gives them, as in the
reference it is the order ``torch.sort`` gives them: either is a fair draw, not always the
same one. Every op here works row by row (softmax, cumsum,
sort, argmax along the vocabulary), so a row's bits do not depend on the rows beside it
(tests/unit/test_sampler.py checks it, and that greedy ids equal the reference's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from pdserve.sampling import GREEDY_BELOW_TEMPERATURE, SamplingParams, TokenLogprob, TopLogprob

_BIT_SHIFTS = torch.arange(8, dtype=torch.uint8)  # a bitmask byte's 8 tokens, low bit first
CANDIDATES = 1024  # a top-p row without top-k looks for its nucleus among this many tokens first


@dataclass
class Draw:
    """One token to pick: from logits row ``row`` under ``params`` (its fork, for a choice of
    an n > 1 request). ``position``: the token's index in its sequence (the seed's key);
    ``num_generated``: tokens generated before it (min_tokens); ``token_ids`` /
    ``num_prompt_tokens``: the sequence so far and its prompt's length (read only with
    penalties); ``mask``: a grammar's bitmask ``[ceil(vocab / 32)]`` int32, bit clear =
    disallowed (pdserve/structured.py ``fill_masks``), or None."""

    row: int
    params: SamplingParams
    position: int
    num_generated: int = 0
    token_ids: list[int] | None = None
    num_prompt_tokens: int = 0
    mask: torch.Tensor | None = None


class Sampled(NamedTuple):
    token_ids: list[int]  # one per draw, in order
    logprobs: list[TokenLogprob | None]  # one per draw: None where params.logprobs is None


def _rows(indices: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(indices, dtype=torch.long, device=device)


def _apply_masks(x: torch.Tensor, draws: list[Draw], mask_row=None) -> None:
    """Grammar bitmasks onto x [D, vocab] float32, in place: -inf where a token's bit is clear.
    ``mask_row(row, words)``: a backend's kernel for one row (the cpu backend's C loop, which
    skips the all-set words a JSON mask is mostly made of); else torch ops over every masked row."""
    which = [i for i, d in enumerate(draws) if d.mask is not None]
    if not which:
        return
    if mask_row is not None:
        for i in which:
            mask_row(x[i], draws[i].mask)
        return
    vocab, idx = x.shape[1], _rows(which, x.device)
    words = torch.stack([draws[i].mask for i in which]).to(x.device, non_blocking=True)  # [R, ceil(vocab / 32)] int32
    shifts = _BIT_SHIFTS.to(x.device)
    # little-endian words: byte b of word w holds tokens 32 w + 8 b .. + 7, low bit first
    allowed = ((words.view(torch.uint8)[:, :, None] >> shifts) & 1).view(len(which), -1)[:, :vocab].bool()  # [R, vocab]
    x.index_copy_(0, idx, torch.where(allowed, x.index_select(0, idx), -math.inf))


def _apply_bias(x: torch.Tensor, draws: list[Draw]) -> None:
    """logit_bias added in place (each (row, token) once: a dict's keys)."""
    rows, ids, biases = [], [], []
    for i, d in enumerate(draws):
        if d.params.logit_bias:
            rows.extend([i] * len(d.params.logit_bias))
            ids.extend(d.params.logit_bias)
            biases.extend(d.params.logit_bias.values())
    if rows:
        dev = x.device
        x.index_put_((_rows(rows, dev), _rows(ids, dev)), torch.tensor(biases, dtype=torch.float32, device=dev), accumulate=True)


def _apply_penalties(x: torch.Tensor, draws: list[Draw]) -> None:
    """sampling.apply_penalties on every row that has penalties, in place, by the same float32
    element ops (a row without one of the three multiplies by 1 or subtracts 0: unchanged)."""
    which = [i for i, d in enumerate(draws) if d.params.has_penalties]
    if not which:
        return
    dev, vocab = x.device, x.shape[1]
    out_rows, out_ids, prompt_rows, prompt_ids = [], [], [], []
    for r, i in enumerate(which):
        d = draws[i]
        if d.token_ids is None:
            raise ValueError("penalties need the sequence's token_ids")
        out = d.token_ids[d.num_prompt_tokens:]
        out_rows.extend([r] * len(out))
        out_ids.extend(out)
        prompt_rows.extend([r] * d.num_prompt_tokens)
        prompt_ids.extend(d.token_ids[: d.num_prompt_tokens])
    counts = torch.zeros(len(which), vocab, dtype=torch.long, device=dev)  # [P, vocab] output counts
    counts.index_put_((_rows(out_rows, dev), _rows(out_ids, dev)), torch.ones(len(out_ids), dtype=torch.long, device=dev), accumulate=True)
    output_seen = counts > 0
    seen = output_seen.clone()
    seen[_rows(prompt_rows, dev), _rows(prompt_ids, dev)] = True
    per_row = torch.tensor([[draws[i].params.repetition_penalty, draws[i].params.frequency_penalty, draws[i].params.presence_penalty]
                            for i in which], dtype=torch.float32, device=dev)  # [P, 3]
    idx = _rows(which, dev)
    y = x.index_select(0, idx)
    penalty = torch.where(seen, per_row[:, 0:1], 1.0)
    y *= torch.where(y > 0, 1.0 / penalty, penalty)
    y -= per_row[:, 1:2] * counts
    y -= per_row[:, 2:3] * output_seen
    x.index_copy_(0, idx, y)


def _apply_bans(x: torch.Tensor, draws: list[Draw], eos_token_ids: frozenset[int]) -> None:
    """Below min_tokens, the stop tokens and EOS (unless ignore_eos) at -inf, in place; a row
    whose grammar allows only those keeps them (it ends the output)."""
    rows, ids = [], []
    for i, d in enumerate(draws):
        if d.num_generated < d.params.min_tokens:
            banned = [*d.params.stop_token_ids, *([] if d.params.ignore_eos else eos_token_ids)]
            rows.extend([i] * len(banned))
            ids.extend(banned)
    if rows:
        dev = x.device
        which = _rows(sorted(set(rows)), dev)
        before = x.index_select(0, which)
        x[_rows(rows, dev), _rows(ids, dev)] = -math.inf
        after = x.index_select(0, which)
        x.index_copy_(0, which, torch.where(torch.isfinite(after).any(dim=1, keepdim=True), after, before))


def _race(probs: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> torch.Tensor:
    """argmax(probs / q), q ~ Exp(1) per entry: a column of each row of probs [R, C] drawn with
    probability probs (rows need not sum to 1). Row r's q comes from its own generator where
    params[r] has a seed (keyed by (seed, position): the same draw alone or in any batch)."""
    q = torch.empty_like(probs).exponential_()  # unseeded rows: one draw for all
    for r, p in enumerate(params):  # seeded rows: each its own stream (only these loop)
        if p.seed is not None:
            generator = torch.Generator(device=probs.device).manual_seed((p.seed * 1_000_003 + positions[r]) % (1 << 63))
            q[r].exponential_(generator=generator)
    q.clamp_min_(torch.finfo(torch.float32).tiny)  # q = 0 would make a filtered token's 0 / q NaN, which argmax takes
    return torch.argmax(probs / q, dim=-1)


def _draw(x: torch.Tensor, draws: list[Draw], which: list[int]) -> torch.Tensor:
    """Sampled ids [len(which)] (int64, on x's device) of rows ``which`` of x [D, vocab].

    Temperature, then min-p over the whole vocabulary. A row with top-k takes its 2k + 16
    most likely tokens (``torch.topk``, rows grouped by that count) and keeps the k and every
    token tied with the k-th (as the reference does), its probabilities renormalised over
    them, top-p applied over them in order; without min-p its candidates come from the
    unscaled logits (temperature keeps their order) and only they are scaled. A row with
    top-p alone searches its CANDIDATES most likely tokens first (their probabilities over
    the whole vocabulary). A row goes through the reference's whole-row path instead where
    its candidates do not settle it: the ties with the k-th run past them, or they do not
    pass top_p of the mass (one small copy to the host says which). Rows with no filter race
    over the whole vocabulary."""
    dev, vocab = x.device, x.shape[1]
    params = [draws[i].params for i in which]
    positions = [draws[i].position for i in which]
    temps = torch.tensor([p.temperature for p in params], device=dev)[:, None]  # [S, 1]
    # rows read whole (min-p, top-p alone, no filter): scaled once, here; y_at: row -> its row of y
    full = [r for r, p in enumerate(params) if p.min_p > 0 or p.top_k <= 0]
    y_at = {r: n for n, r in enumerate(full)}
    y = x.index_select(0, _rows([which[r] for r in full], dev)) / temps[full] if full else None  # [F, vocab]
    min_p = [y_at[r] for r, p in enumerate(params) if p.min_p > 0]
    if min_p:
        idx = _rows(min_p, dev)
        z = y.index_select(0, idx)
        probs = torch.softmax(z, dim=-1)
        floor = torch.tensor([params[full[n]].min_p for n in min_p], device=dev)[:, None] * probs.max(dim=-1, keepdim=True).values
        y.index_copy_(0, idx, z.masked_fill(probs < floor, -math.inf))
    ids = torch.empty(len(which), dtype=torch.long, device=dev)
    groups: dict[tuple[int, bool], list[int]] = {}  # (candidates, read from y) -> rows
    for r, p in enumerate(params):
        if p.top_k > 0 or p.top_p < 1:  # top-k: twice k and 16 more, for the tokens that tie with the k-th
            groups.setdefault((min(2 * p.top_k + 16 if p.top_k > 0 else CANDIDATES, vocab), r in y_at), []).append(r)
    whole = [r for r, p in enumerate(params) if p.top_k <= 0 and p.top_p >= 1]  # no filter: the whole vocabulary
    for (k, from_y), rows in sorted(groups.items()):
        idx = _rows(rows, dev)
        z = y.index_select(0, _rows([y_at[r] for r in rows], dev)) if from_y else x.index_select(0, _rows([which[r] for r in rows], dev))
        vals, cand = torch.topk(z, k, dim=-1)  # [G, k] most likely first (unscaled where not from_y)
        by_k = torch.tensor([params[r].top_k > 0 for r in rows], device=dev)[:, None]
        kth = vals.gather(1, torch.tensor([[min(max(params[r].top_k, 1), k) - 1] for r in rows], device=dev))  # [G, 1] the k-th value
        kth = torch.where(by_k, kth, -math.inf)
        settled = ~by_k | (vals[:, -1:] < kth) | (k >= vocab)  # top-k: every tie with the k-th is among the candidates
        vals = vals.masked_fill(vals < kth, -math.inf)  # top-k: the k and their ties
        if not from_y:
            vals = vals / temps[rows]
        top_k_only = all(params[r].top_k > 0 for r in rows)
        log_norm = torch.logsumexp(vals, -1, keepdim=True)  # [G, 1]
        if not top_k_only:  # top-p alone: normalised over the whole vocabulary
            log_norm = torch.where(by_k, log_norm, torch.logsumexp(z, -1, keepdim=True))
        probs = torch.exp(vals - log_norm)  # [G, k]: over the k (top-k), over the vocabulary (top-p alone)
        top_p = torch.tensor([params[r].top_p for r in rows], device=dev)[:, None]
        cum = torch.cumsum(probs, dim=-1)
        # top-p alone: the candidates settle it where they hold more than top_p (the next token's mass before it)
        settled &= by_k | (cum[:, -1:] > top_p) | (k >= vocab)
        whole += [r for r, ok in zip(rows, settled[:, 0].tolist()) if not ok]
        probs.masked_fill_(cum - probs > top_p, 0.0)
        picked = cand.gather(1, _race(probs, [params[r] for r in rows], [positions[r] for r in rows])[:, None])[:, 0]
        ids.index_copy_(0, idx, picked)
    if whole:  # the reference's path: the whole row, top-k by its k-th value, top-p by a sort
        whole.sort()
        w_rows = _rows(whole, dev)
        zw = x.index_select(0, _rows([which[r] for r in whole], dev)) / temps[whole]  # [W, vocab]
        with_y = [w for w, r in enumerate(whole) if r in y_at]
        if with_y:  # (min-p already applied there)
            zw.index_copy_(0, _rows(with_y, dev), y.index_select(0, _rows([y_at[whole[w]] for w in with_y], dev)))
        for k in sorted({params[r].top_k for r in whole if params[r].top_k > 0}):
            ks = _rows([w for w, r in enumerate(whole) if params[r].top_k == k], dev)
            zk = zw.index_select(0, ks)
            kth = torch.topk(zk, min(k, vocab), dim=-1).values[:, -1:]
            zw.index_copy_(0, ks, zk.masked_fill(zk < kth, -math.inf))
        probs = torch.softmax(zw, dim=-1)  # [W, vocab]
        sort_rows = [w for w, r in enumerate(whole) if params[r].top_p < 1]
        if sort_rows:
            sidx = _rows(sort_rows, dev)
            sorted_probs, order = torch.sort(probs.index_select(0, sidx), dim=-1, descending=True)
            ps = torch.tensor([params[whole[w]].top_p for w in sort_rows], device=dev)[:, None]
            sorted_probs.masked_fill_(torch.cumsum(sorted_probs, dim=-1) - sorted_probs > ps, 0.0)
            probs.index_copy_(0, sidx, torch.zeros_like(sorted_probs).scatter_(1, order, sorted_probs))
        ids.index_copy_(0, w_rows, _race(probs, [params[r] for r in whole], [positions[r] for r in whole]))
    return ids


def sample_batch(logits: torch.Tensor, draws: list[Draw], eos_token_ids: frozenset[int] = frozenset(), mask_row=None) -> Sampled:
    """Pick a token for every draw. logits: [rows, vocab] (any float dtype, any device; not
    modified); draws: ``Draw``s over its rows (a row may have several). Returns their ids and,
    where asked, logprobs: log_softmax of the row after its grammar's mask and before the
    rest, as the reference reports them (``sampling.token_logprob``). ``mask_row``: a
    backend's one-row mask kernel (``_apply_masks``), or None. Raises ValueError for a draw
    with penalties and no ``token_ids``."""
    if not draws:
        return Sampled([], [])
    dev = logits.device
    rows = [d.row for d in draws]
    edits = any(d.mask is not None or d.params.logit_bias or d.params.has_penalties or d.num_generated < d.params.min_tokens for d in draws)
    if not edits and logits.dtype == torch.float32 and rows == list(range(len(draws))):
        x = logits[: len(draws)]  # [D, vocab]: read only (no processor writes it), so no copy
    else:
        x = logits.index_select(0, _rows(rows, dev)).float()  # [D, vocab], a copy the processors edit in place
    _apply_masks(x, draws, mask_row)
    want = [i for i, d in enumerate(draws) if d.params.logprobs is not None]
    logprobs = torch.log_softmax(x.index_select(0, _rows(want, dev)), dim=-1) if want else None  # [W, vocab]
    _apply_bias(x, draws)
    _apply_penalties(x, draws)
    _apply_bans(x, draws, eos_token_ids)
    ids = x.max(dim=-1).indices  # [D] the argmax, the first where tied (faster than argmax here): greedy rows keep it
    sampled = [i for i, d in enumerate(draws) if d.params.temperature >= GREEDY_BELOW_TEMPERATURE]
    if sampled:
        ids.index_copy_(0, _rows(sampled, dev), _draw(x, draws, sampled))
    out: list[TokenLogprob | None] = [None] * len(draws)
    if want:
        chosen = logprobs.gather(1, ids.index_select(0, _rows(want, dev))[:, None])[:, 0].tolist()  # [W]
        tops: dict[int, tuple[list, list]] = {}  # draw -> (values, ids) of its own top-n
        for n in sorted({draws[i].params.logprobs for i in want if draws[i].params.logprobs}):  # per n: a draw's list is its own
            at = [w for w, i in enumerate(want) if draws[i].params.logprobs == n]
            top = torch.topk(logprobs.index_select(0, _rows(at, dev)), n, dim=-1)
            for w, values, indices in zip(at, top.values.tolist(), top.indices.tolist()):
                tops[want[w]] = (values, indices)
    token_ids = ids.tolist()  # the one copy of the ids to the host
    for w, i in enumerate(want):
        values, indices = tops.get(i, ([], []))
        out[i] = TokenLogprob(token_ids[i], chosen[w], [TopLogprob(t, v) for t, v in zip(indices, values)])
    return Sampled(token_ids, out)
