"""The batched sampler (pdserve/engine/sampler.py) against the one-row reference
(pdserve/sampling.py ``sample`` and ``token_logprob``): greedy ids and logprobs equal it
exactly under every logit processor; a row's draw and logprobs are the same bits alone and in
any batch; seeded draws repeat; filters keep the reference's support; and the number of
tensor ops does not grow with the batch."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pdserve.engine.sampler import Draw, sample_batch
from pdserve.sampling import SamplingParams, sample, token_logprob
from pdserve.structured import apply_mask

VOCAB = 1000
EOS = frozenset({2})


def random_params(rng: random.Random, greedy: bool) -> SamplingParams:
    kw = {}
    if rng.random() < 0.4:
        kw["logit_bias"] = {rng.randrange(VOCAB): rng.uniform(-100, 100) for _ in range(rng.randrange(1, 4))}
    if rng.random() < 0.4:
        kw.update(repetition_penalty=rng.choice([1.0, 0.7, 1.3]), frequency_penalty=rng.choice([0.0, 0.5, -1.0]),
                  presence_penalty=rng.choice([0.0, 1.5]))
    if rng.random() < 0.3:
        kw.update(min_tokens=3, stop_token_ids=(rng.randrange(VOCAB),))
    if rng.random() < 0.5:
        kw["logprobs"] = rng.choice([0, 1, 5])
    if not greedy:
        kw.update(temperature=rng.choice([0.5, 1.0, 1.7]), seed=rng.randrange(1 << 40))
        if rng.random() < 0.4:
            kw["top_k"] = rng.choice([1, 5, 50])
        if rng.random() < 0.4:
            kw["top_p"] = rng.choice([0.5, 0.9])
        if rng.random() < 0.4:
            kw["min_p"] = rng.choice([0.05, 0.2])
    return SamplingParams(max_tokens=64, **kw)


def random_draws(rng: random.Random, rows: int, greedy_share: float) -> list[Draw]:
    draws = []
    for r in range(rows):
        params = random_params(rng, rng.random() < greedy_share)
        ids = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 30))]
        prompt = rng.randrange(1, len(ids) + 1)
        mask = None
        if rng.random() < 0.3:
            mask = torch.tensor([rng.getrandbits(32) - (1 << 31) for _ in range(-(-VOCAB // 32))], dtype=torch.int32)
        draws.append(Draw(r, params, len(ids), rng.randrange(0, 5), ids, prompt, mask))
    return draws


def reference(logits: torch.Tensor, d: Draw):
    row = logits[d.row].float()
    if d.mask is not None:
        row = apply_mask(row, d.mask)
    token = sample(row, d.params, d.position, d.num_generated, EOS, d.token_ids, d.num_prompt_tokens)
    return token, (token_logprob(row, token, d.params.logprobs) if d.params.logprobs is not None else None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_ids_and_every_logprob_equal_the_reference_exactly(dtype):
    rng = random.Random(7)
    logits = (torch.randn(48, VOCAB, generator=torch.Generator().manual_seed(1)) * 4).to(dtype)
    draws = random_draws(rng, 48, greedy_share=1.0)
    got = sample_batch(logits, draws, EOS)
    for d, token, lp in zip(draws, got.token_ids, got.logprobs):
        want_token, want_lp = reference(logits, d)
        assert token == want_token
        if want_lp is None:
            assert lp is None
        else:  # the chosen token's logprob to the bit; the top list's values too (ties may order differently)
            assert lp.token_id == want_lp.token_id and lp.logprob == want_lp.logprob
            assert [v for _, v in lp.top] == [v for _, v in want_lp.top]


def test_a_draw_is_the_same_bits_alone_and_anywhere_in_a_batch():
    rng = random.Random(11)
    logits = torch.randn(40, VOCAB, generator=torch.Generator().manual_seed(2)) * 3
    draws = random_draws(rng, 40, greedy_share=0.3)
    together = sample_batch(logits, draws, EOS)
    for i in rng.sample(range(40), 12):
        alone = sample_batch(logits, [draws[i]], EOS)
        assert alone.token_ids[0] == together.token_ids[i] and alone.logprobs[0] == together.logprobs[i]
    shuffled = draws[20:] + draws[:20]  # another order, and the rows they read moved too
    moved = sample_batch(torch.cat([logits[20:], logits[:20]]),
                         [Draw(k, d.params, d.position, d.num_generated, d.token_ids, d.num_prompt_tokens, d.mask) for k, d in enumerate(shuffled)], EOS)
    assert moved.token_ids == together.token_ids[20:] + together.token_ids[:20]
    assert moved.logprobs == together.logprobs[20:] + together.logprobs[:20]


def test_seeded_draws_repeat_and_depend_on_seed_and_position():
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(3))
    draws = [Draw(0, SamplingParams(temperature=1.0, seed=1234), position=p) for p in range(30)]
    a, b = sample_batch(logits, draws).token_ids, sample_batch(logits, draws).token_ids
    assert a == b and len(set(a)) > 5
    other = [Draw(0, SamplingParams(temperature=1.0, seed=99), position=p) for p in range(30)]
    assert sample_batch(logits, other).token_ids != a


def test_filters_keep_the_references_support():
    """top-k, top-p and min-p: every draw lies where the reference's filtered distribution is
    non-zero; top_k = 1 and a tiny top_p are the argmax."""
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(4)) * 2
    row = logits[0]
    best = int(row.argmax())
    order = torch.argsort(row, descending=True)
    probs = torch.softmax(row, -1)
    cases = [
        (SamplingParams(temperature=1.0, top_k=1), {best}),
        (SamplingParams(temperature=1.0, top_p=1e-6), {best}),
        (SamplingParams(temperature=1.0, top_k=20), set(order[:20].tolist())),
        (SamplingParams(temperature=1.0, top_p=0.3), set(order[: int((torch.cumsum(probs[order], 0) - probs[order] <= 0.3).sum())].tolist())),
        (SamplingParams(temperature=1.0, min_p=0.3), set(torch.nonzero(probs >= 0.3 * probs.max()).flatten().tolist())),
    ]
    for params, support in cases:
        got = sample_batch(logits, [Draw(0, params, position=p) for p in range(300)]).token_ids
        assert set(got) <= support, params
        if len(support) > 1:
            assert len(set(got)) > 1


def test_draws_follow_the_softmax():
    """4 tokens of known probabilities, 20,000 seeded draws (deterministic): each frequency
    within 4 standard deviations of its probability."""
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]])
    p = torch.softmax(logits[0] / 0.8, -1).tolist()
    n = 20000
    counts = Counter(sample_batch(logits, [Draw(0, SamplingParams(temperature=0.8, seed=s), position=0) for s in range(n)]).token_ids)
    for t in range(4):
        assert abs(counts[t] / n - p[t]) < 4 * math.sqrt(p[t] * (1 - p[t]) / n), (t, counts[t] / n, p[t])


def test_a_grammar_mask_keeps_disallowed_tokens_out_of_the_draw_and_the_logprobs():
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(5))
    allowed = [3, 17, 999]
    words = torch.zeros(-(-VOCAB // 32), dtype=torch.int64)
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    mask = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    draws = [Draw(0, SamplingParams(temperature=2.0, seed=s, logprobs=3), position=0, mask=mask) for s in range(200)]
    got = sample_batch(logits, draws)
    assert set(got.token_ids) <= set(allowed) and len(set(got.token_ids)) > 1
    assert {t for t, _ in got.logprobs[0].top} == set(allowed)


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def test_the_number_of_tensor_ops_does_not_grow_with_the_batch():
    """Batches of 2 and 32 draws of the same kinds, all but seeded (a seeded row draws from its
    own generator: one op per seeded row), run the same ops, the same number of times."""
    logits = torch.randn(32, VOCAB)
    kinds = [SamplingParams(temperature=0.9, top_k=5, top_p=0.8, min_p=0.1, logprobs=2, repetition_penalty=1.2,
                            logit_bias={5: 1.0}, min_tokens=2, stop_token_ids=(9,)),
             SamplingParams(logprobs=1, frequency_penalty=0.5)]
    mask = torch.full((-(-VOCAB // 32),), -1, dtype=torch.int32)

    def count(rows: int) -> Counter:
        draws = [Draw(r, kinds[r % 2], 10, 0, [1, 2, 3, 4], 2, mask) for r in range(rows)]
        with CountOps() as c:
            sample_batch(logits[:rows], draws, EOS)
        return c.ops

    assert count(2) == count(32)


@pytest.mark.parametrize("peaked", [True, False])
def test_top_p_alone_over_a_large_vocabulary_keeps_the_nucleus(peaked):
    """A vocabulary past sampler.CANDIDATES: a peaked row's nucleus lies among its candidates
    (no sort of the row); a flat row's does not, and the whole row is sorted. Either way every
    draw is in the reference's nucleus, and a seeded draw is the same alone and in a batch."""
    from pdserve.engine.sampler import CANDIDATES

    vocab = 4 * CANDIDATES
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(2, vocab, generator=gen) * (3.0 if peaked else 0.05)
    probs = torch.softmax(logits[0], -1)
    order = torch.argsort(probs, descending=True)
    inside = torch.cumsum(probs[order], 0) - probs[order] <= 0.9
    nucleus = set(order[inside].tolist())
    assert (1 < len(nucleus) < CANDIDATES) == peaked
    draws = [Draw(0, SamplingParams(temperature=1.0, top_p=0.9, seed=s), position=0) for s in range(200)]
    got = sample_batch(logits, draws).token_ids
    assert set(got) <= nucleus and len(set(got)) > (2 if peaked else 20)
    mixed = [Draw(1, SamplingParams(temperature=1.0, top_k=7, seed=1), position=3), draws[5], Draw(1, SamplingParams(temperature=0.5), position=3)]
    assert sample_batch(logits, mixed).token_ids[1] == got[5]


def test_greedy_takes_the_first_of_tied_maxima_as_the_reference():
    logits = torch.zeros(3, VOCAB)
    logits[:, [700, 40, 999]] = 1.0
    assert sample_batch(logits, [Draw(r, SamplingParams(), position=0) for r in range(3)]).token_ids == [40] * 3
    assert sample(logits[0], SamplingParams(), position=0) == 40


def test_the_cpu_backends_mask_kernel_and_the_torch_ops_mask_the_same():
    from pdserve.engine.cpu import ops

    rng = random.Random(13)
    logits = torch.randn(24, VOCAB, generator=torch.Generator().manual_seed(8))
    draws = random_draws(rng, 24, greedy_share=0.5)
    for d in draws[::2]:
        d.mask = torch.tensor([rng.getrandbits(32) - (1 << 31) for _ in range(-(-VOCAB // 32))], dtype=torch.int32)
    assert sample_batch(logits, draws, EOS, ops.mask_logits_) == sample_batch(logits, draws, EOS)


def test_top_k_keeps_every_token_tied_with_the_kth_as_the_reference():
    for row, k, support in (([2.0, 2.0, 2.0, 0.0], 1, {0, 1, 2}), ([3.0, 2.0, 2.0, 2.0, 0.0], 2, {0, 1, 2, 3})):
        logits = torch.tensor([row])
        draws = [Draw(0, SamplingParams(temperature=1.0, top_k=k, seed=s), position=0) for s in range(300)]
        assert set(sample_batch(logits, draws).token_ids) == support
        assert {sample(logits[0], d.params, 0) for d in draws} == support
    # more ties than the candidates hold (2k + 16): the whole row, as the reference keeps it
    got = sample_batch(torch.zeros(1, 200), [Draw(0, SamplingParams(temperature=1.0, top_k=5, seed=s), position=0) for s in range(300)])
    assert len(set(got.token_ids)) > 100


def test_a_nucleus_that_exactly_fills_the_candidates_takes_the_next_token_too(monkeypatch):
    """8 equal logits, top_p 0.5, 4 candidates (sampler.CANDIDATES set low): the candidates
    hold exactly 0.5, so the reference's nucleus has a fifth token (a token is kept while the
    mass before it is at most top_p): the whole row is sorted and 5 tokens are drawn."""
    from pdserve.engine import sampler

    monkeypatch.setattr(sampler, "CANDIDATES", 4)
    logits = torch.zeros(1, 8)
    draws = [Draw(0, SamplingParams(temperature=1.0, top_p=0.5, seed=s), position=0) for s in range(400)]
    assert len(set(sample_batch(logits, draws).token_ids)) == 5 == len({sample(logits[0], d.params, 0) for d in draws})


def test_a_draws_top_logprobs_are_its_own_whatever_the_batch_asks():
    logits = torch.zeros(2, VOCAB)  # every token tied: which ids come first is topk's choice for that n
    few = Draw(0, SamplingParams(logprobs=2), position=0)
    alone = sample_batch(logits, [few]).logprobs[0]
    beside = sample_batch(logits, [few, Draw(1, SamplingParams(logprobs=20), position=0)]).logprobs[0]
    assert alone == beside and len(alone.top) == 2
