import math

import pytest
import torch

from pdserve.errors import InvalidRequestError
from pdserve.sampling import SamplingParams, finish_reason, sample


@pytest.mark.parametrize(
    "params, prompt_len, message",
    [
        (SamplingParams(), 0, "prompt is empty"),
        (SamplingParams(max_tokens=0), 5, "max_tokens must be >= 1"),
        (SamplingParams(max_tokens=100), 8100, "exceeds the model's context of 8192"),
        (SamplingParams(temperature=-0.5), 5, "temperature must be a finite number >= 0"),
        (SamplingParams(top_p=0.0), 5, "top_p"),
        (SamplingParams(seed=-1), 5, "seed must be in"),
        (SamplingParams(seed=2**63), 5, "seed must be in"),
    ],
)
def test_validate_names_the_problem(params, prompt_len, message):
    with pytest.raises(InvalidRequestError, match=message):
        params.validate(prompt_len, 8192)


def test_validate_accepts_the_exact_context():
    SamplingParams(max_tokens=92).validate(8100, 8192)


def test_greedy_is_argmax():
    logits = torch.tensor([0.1, 3.0, -1.0, 2.9])
    assert sample(logits, SamplingParams(), position=0) == 1


def test_seeded_sampling_depends_only_on_seed_and_position():
    logits = torch.randn(1000)
    params = SamplingParams(temperature=1.0, seed=1234)
    a = [sample(logits, params, position=p) for p in range(20)]
    b = [sample(logits, params, position=p) for p in range(20)]
    assert a == b
    assert len(set(a)) > 1  # positions give different draws
    c = [sample(logits, SamplingParams(temperature=1.0, seed=99), position=p) for p in range(20)]
    assert a != c


def test_top_k_1_and_tiny_top_p_are_greedy():
    logits = torch.randn(500)
    best = int(logits.argmax())
    for p in range(10):
        assert sample(logits, SamplingParams(temperature=1.0, top_k=1), position=p) == best
        assert sample(logits, SamplingParams(temperature=1.0, top_p=1e-6), position=p) == best


def test_finish_reason():
    eos = frozenset({2})
    assert finish_reason(2, 1, SamplingParams(max_tokens=5), eos) == "stop"
    assert finish_reason(2, 1, SamplingParams(max_tokens=5, ignore_eos=True), eos) is None
    assert finish_reason(7, 1, SamplingParams(max_tokens=5, stop_token_ids=(7,)), eos) == "stop"
    assert finish_reason(7, 5, SamplingParams(max_tokens=5), eos) == "length"
    assert finish_reason(7, 4, SamplingParams(max_tokens=5), eos) is None


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    logits = torch.tensor([0.0, 1.0, 9.0, 5.0, 8.0])  # EOS (2) is the argmax, stop token 4 next
    params = SamplingParams(max_tokens=5, min_tokens=2, stop_token_ids=(4,))
    eos = frozenset({2})
    assert sample(logits, params, position=0, num_generated=0, eos_token_ids=eos) == 3
    assert sample(logits, params, position=1, num_generated=1, eos_token_ids=eos) == 3
    assert sample(logits, params, position=2, num_generated=2, eos_token_ids=eos) == 2  # reached: EOS allowed
    assert finish_reason(2, 3, params, eos) == "stop"
    assert sample(logits, SamplingParams(min_tokens=1, ignore_eos=True), 0, 0, eos) == 2  # ignore_eos: EOS is a token


def test_min_tokens_and_stop_strings_are_validated():
    with pytest.raises(InvalidRequestError, match="min_tokens"):
        SamplingParams(max_tokens=2, min_tokens=3).validate(1, 100)
    with pytest.raises(InvalidRequestError, match="stop"):
        SamplingParams(stop=("",)).validate(1, 100)


def test_token_logprob_is_log_softmax_with_top_alternatives():
    from pdserve.sampling import token_logprob

    logits = torch.tensor([1.0, 3.0, 2.0, 0.0])
    lp = token_logprob(logits, 2, num_top=2)
    want = torch.log_softmax(logits, -1)
    assert lp.token_id == 2 and lp.logprob == pytest.approx(float(want[2]))
    assert [t for t, _ in lp.top] == [1, 2] and lp.top[0][1] == pytest.approx(float(want[1]))
    assert token_logprob(logits, 0, num_top=0).top == []
    with pytest.raises(InvalidRequestError, match="logprobs"):
        SamplingParams(logprobs=21).validate(1, 100)


@pytest.mark.parametrize("params, message", [
    (SamplingParams(repetition_penalty=0.0), "repetition_penalty must be a finite number > 0"),
    (SamplingParams(repetition_penalty=float("nan")), "repetition_penalty"),
    (SamplingParams(presence_penalty=2.5), r"presence_penalty must be in \[-2, 2\]"),
    (SamplingParams(frequency_penalty=float("nan")), r"frequency_penalty must be in \[-2, 2\]"),
])
def test_bad_penalties_are_named(params, message):
    with pytest.raises(InvalidRequestError, match=message):
        params.validate(5, 100)


def test_penalties_follow_vllms_formula_exactly():
    """vLLM's apply_penalties: repetition over prompt + output (positive logits times 1/p,
    others times p), then - frequency * output count - presence * (seen in the output)."""
    from pdserve.sampling import apply_penalties

    logits = torch.tensor([2.0, -1.0, 3.0, 0.5, -2.0, 4.0])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    got = apply_penalties(logits, params, token_ids=[0, 1, 2, 2, 3], num_prompt_tokens=2)
    # token 0, 1: prompt only (repetition); 2: output twice; 3: output once; 4, 5: unseen
    assert got.tolist() == [1.0, -2.0, 1.5 - 1.0 - 0.25, 0.25 - 0.5 - 0.25, -2.0, 4.0]
    assert logits.tolist() == [2.0, -1.0, 3.0, 0.5, -2.0, 4.0]  # the row itself is untouched


def test_greedy_with_penalties_picks_from_the_penalised_logits():
    logits = torch.tensor([0.0, 3.0, 2.5, 1.0])
    assert sample(logits, SamplingParams(), position=3) == 1
    # token 1 was generated once: frequency 1.0 brings it to 2.0, below token 2
    assert sample(logits, SamplingParams(frequency_penalty=1.0), position=3, token_ids=[0, 1], num_prompt_tokens=1) == 2
    # in the prompt only: frequency and presence ignore it, repetition does not
    assert sample(logits, SamplingParams(presence_penalty=2.0), position=3, token_ids=[1, 0], num_prompt_tokens=2) == 1
    assert sample(logits, SamplingParams(repetition_penalty=1.5), position=3, token_ids=[1, 0], num_prompt_tokens=2) == 2
    # neutral values change nothing and need no history
    assert sample(logits, SamplingParams(repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0), position=3) == 1


@pytest.mark.parametrize("params, message", [
    (SamplingParams(min_p=1.5), r"min_p must be in \[0, 1\]"),
    (SamplingParams(min_p=-0.1), r"min_p must be in \[0, 1\]"),
    (SamplingParams(min_p=float("nan")), r"min_p must be in \[0, 1\]"),
    (SamplingParams(logit_bias={1: 100.5}), r"logit_bias\[1\] must be in \[-100, 100\]"),
    (SamplingParams(logit_bias={1: float("nan")}), r"logit_bias\[1\] must be in"),
    (SamplingParams(logit_bias={-1: 1.0}), "logit_bias keys must be token ids"),
    (SamplingParams(logit_bias={"3": 1.0}), "logit_bias keys must be token ids"),
])
def test_bad_min_p_and_logit_bias_are_named(params, message):
    with pytest.raises(InvalidRequestError, match=message):
        params.validate(5, 100)


def test_logit_bias_ids_past_the_vocabulary_are_named():
    SamplingParams(logit_bias={99: 1.0}).validate(5, 100, vocab_size=100)
    with pytest.raises(InvalidRequestError, match="logit_bias has 100, outside the vocabulary of 100"):
        SamplingParams(logit_bias={100: 1.0}).validate(5, 100, vocab_size=100)


def test_logit_bias_is_added_before_the_penalties_and_moves_greedy():
    """vLLM v1's order: bias, then penalties. Token 3 (logit 1.0, in the prompt) with bias 2.8:
    (1.0 + 2.8) / 2 = 1.9 under repetition penalty 2 loses to token 1's 3.0; penalised
    first it would be 0.5 + 2.8 = 3.3 and win."""
    logits = torch.tensor([0.0, 3.0, 2.5, 1.0])
    assert sample(logits, SamplingParams(logit_bias={3: 2.8}), position=3) == 3
    assert sample(logits, SamplingParams(logit_bias={3: 2.8}, repetition_penalty=2.0), position=3, token_ids=[3, 0], num_prompt_tokens=2) == 1
    assert sample(logits, SamplingParams(logit_bias={1: -100.0}), position=3) == 2
    assert logits.tolist() == [0.0, 3.0, 2.5, 1.0]  # the row itself is untouched
    row = torch.tensor([0.0, 3.0, 2.5, 1.0], dtype=torch.bfloat16)  # a bf16 row: the bias is added in float32, as vLLM's
    assert sample(row, SamplingParams(logit_bias={2: 0.50390625}), position=3) == 2  # 3.0039 in bf16 would tie token 1's 3.0


def test_min_p_draws_from_vllms_filtered_distribution():
    """After temperature, tokens with probability below min_p x the top one's are out
    (vLLM's MinPLogitsProcessor); the seeded draws equal a draw from that distribution with
    the same random stream, and greedy ignores min_p."""
    torch.manual_seed(0)
    logits = torch.randn(64) * 2
    params = SamplingParams(temperature=3.0, min_p=0.2, seed=11)
    scaled = logits / 3.0
    probs = torch.softmax(scaled, -1)
    kept = probs >= 0.2 * probs.max()
    want_probs = torch.softmax(scaled.masked_fill(~kept, -math.inf), -1)
    got, unfiltered = [], []
    for position in range(200):
        generator = torch.Generator().manual_seed((11 * 1_000_003 + position) % (1 << 63))
        want = int(torch.multinomial(want_probs, 1, generator=generator))
        got.append(sample(logits, params, position=position))
        assert got[-1] == want, position
        unfiltered.append(sample(logits, SamplingParams(temperature=3.0, seed=11), position=position))
    assert all(kept[t] for t in got) and 1 < int(kept.sum()) < 64
    assert not all(kept[t] for t in unfiltered)  # without min_p the draws reach the dropped tokens
    assert sample(logits, SamplingParams(min_p=0.9), position=0) == int(torch.argmax(logits))
