"""Structured output (pdserve/structured.py) on the real model and tokenizer: each kind of
constraint gives output that follows it and ends with "stop"; a constraint that does not
compile is refused by name; the grammar cache is bounded; and a constrained request's ids
and logprobs are the same bits alone, in a batch mixed with unconstrained and other
constrained requests, preempted, migrated (its matcher rebuilt from the tokens so far) and
handed from a prefill engine to a decode engine, as unconstrained ones are."""

import json
import random
import re

import pytest
import torch

from pdserve.engine.engine import Engine, EngineConfig
from pdserve.engine.sequence import Sequence
from pdserve.errors import InvalidRequestError
from pdserve.model_loader import load_model, load_tokenizer
from pdserve.sampling import SamplingParams
from pdserve.structured import Grammars, StructuredOutput, apply_mask, fill_masks
from pdserve.worker import eos_token_ids
from test_engine import assert_all_blocks_free, run_to_completion

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
PERSON_SO = StructuredOutput("json", json.dumps(PERSON))


@pytest.fixture(scope="module")
def real(real_model_dir):
    model, tokenizer = load_model(real_model_dir, "float32"), load_tokenizer(real_model_dir)
    eos = eos_token_ids(model, tokenizer)
    return model, tokenizer, Grammars(tokenizer, model.config.vocab_size, eos)


def engine_for(real, **config) -> Engine:
    model, tokenizer, grammars = real
    return Engine(model, EngineConfig(**{"num_blocks": 256, **config}), eos_token_ids(model, tokenizer), 2048, grammars=grammars)


def chat(tokenizer, text: str) -> list[int]:
    return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"])


def request(tokenizer, rid: str, text: str, so: StructuredOutput | None, max_tokens: int = 40, **kw) -> Sequence:
    ids = chat(tokenizer, text)
    return Sequence(rid, ids, len(ids), SamplingParams(max_tokens=max_tokens, structured=so, logprobs=5, **kw))


def outputs(seq: Sequence, start: int = 0) -> list:
    return [(lp.token_id, lp.logprob, [(t.token_id, t.logprob) for t in lp.top]) for lp in seq.logprobs[start:]]


def test_each_kind_of_constraint_is_followed_and_ends_with_stop(real):
    model, tokenizer, _ = real
    engine = engine_for(real)
    cases = {
        "json": (PERSON_SO, "Describe a person as JSON."),
        "json_object": (StructuredOutput("json_object"), "Describe Paris as a JSON object with two keys."),
        "regex": (StructuredOutput("regex", r"\d{3}-\d{4}"), "Write a phone number."),
        "choice": (StructuredOutput("choice", choices=("positive", "negative", "it is \"mixed\"")), "Is 'I love it' positive?"),
        "lark": (StructuredOutput("grammar", 'start: "The answer is " ANSWER "."\nANSWER: "yes" | "no"'), "Is the sky blue?"),
        "gbnf": (StructuredOutput("grammar", 'root ::= "color: " color\ncolor ::= "red" | "green" | "blue"'), "Name a color."),
    }
    seqs = {name: request(tokenizer, name, text, so, max_tokens=60) for name, (so, text) in cases.items()}
    for seq in seqs.values():
        engine.add(seq)
    run_to_completion(engine)
    text = {name: tokenizer.decode(seq.token_ids[seq.num_prompt_tokens:-1]) for name, seq in seqs.items()}
    for name, seq in seqs.items():  # the grammar ended, then EOS (not returned by the loop) with "stop"
        assert seq.finish_reason == "stop" and seq.token_ids[-1] in engine.eos_token_ids, (name, text[name])
    person = json.loads(text["json"])
    assert set(person) == {"name", "age"} and isinstance(person["name"], str) and isinstance(person["age"], int), person
    assert isinstance(json.loads(text["json_object"]), dict)
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", text["regex"]), text["regex"]  # \d is ASCII
    assert text["choice"] in cases["choice"][0].choices
    assert re.fullmatch(r"The answer is (yes|no)\.", text["lark"]) and re.fullmatch(r"color: (red|green|blue)", text["gbnf"]), text
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("so, message", [
    (StructuredOutput("regex", "(("), "the regex constraint does not compile: .*unclosed group"),
    (StructuredOutput("json", '{"type": "objec"}'), "the json constraint does not compile: Invalid type: objec"),
    (StructuredOutput("json", "[1, 2]"), "json schema: a JSON Schema is a JSON object"),
    (StructuredOutput("json", "{bad"), "json schema: Expecting property name"),
    (StructuredOutput("json", '{"$ref": "#/nowhere"}'), "Pointer '/nowhere' does not exist"),
    (StructuredOutput("grammar", "start: undefined_rule"), 'unknown name: "undefined_rule"'),
    (StructuredOutput("grammar", "root ::= missing"), "grammar \\(GBNF\\) does not convert to Lark: Rule 'missing' not found"),
    (StructuredOutput("choice"), "choice needs at least one choice"),
    (StructuredOutput("choice", choices=("a", "")), "no empty string"),
    (StructuredOutput("regex"), "the regex constraint is empty"),
    (StructuredOutput("xml", "<a/>"), "structured output kind 'xml' is not one of"),
])
def test_a_constraint_that_cannot_be_served_is_refused_by_name(real, so, message):
    _, _, grammars = real
    with pytest.raises(InvalidRequestError, match=message):
        grammars.check(so)
    with pytest.raises(InvalidRequestError):  # the engine refuses it too (before any step), and keeps nothing
        engine_for(real, num_blocks=8).add(Sequence("bad", [1, 2, 3], 3, SamplingParams(structured=so)))


def test_an_engine_without_grammars_refuses_a_constrained_request(real):
    model, tokenizer, _ = real
    engine = Engine(model, EngineConfig(num_blocks=8), eos_token_ids(model, tokenizer), 2048)
    with pytest.raises(InvalidRequestError, match="serves no structured output"):
        engine.add(Sequence("x", [1, 2, 3], 3, SamplingParams(structured=PERSON_SO)))
    assert engine.stats()["num_waiting"] == 0


def test_the_grammar_cache_is_a_bounded_lru_keyed_by_the_constraint(real):
    model, tokenizer, _ = real
    grammars = Grammars(tokenizer, model.config.vocab_size, [2], cache_size=2)
    a, b, c = (StructuredOutput("regex", r) for r in ("a+", "b+", "c+"))
    for so in (a, b, a, c):  # a is used again before c comes, so b goes
        grammars.check(so)
    assert len(grammars) == 2 and grammars.num_compiled == 3
    grammars.check(a)
    assert grammars.num_compiled == 3  # a hit
    grammars.check(b)
    assert grammars.num_compiled == 4 and len(grammars) == 2  # b was dropped, compiled again


def test_a_matcher_built_after_tokens_is_in_the_state_of_one_that_took_them_one_by_one(real):
    model, tokenizer, grammars = real
    ids = tokenizer.encode('{"name": "Ada", "age": 3', add_special_tokens=False)
    stepwise = grammars.matcher(PERSON_SO)
    for i, token in enumerate(ids):
        rebuilt = grammars.matcher(PERSON_SO, ids[:i])
        assert torch.equal(fill_masks([rebuilt], model.config.vocab_size), fill_masks([stepwise], model.config.vocab_size)), i
        assert stepwise.consume_token(token)
    with pytest.raises(InvalidRequestError, match="do not follow the json constraint"):
        grammars.matcher(PERSON_SO, tokenizer.encode("[1]", add_special_tokens=False))


def test_apply_mask_sets_exactly_the_disallowed_tokens_to_minus_infinity():
    vocab = 70  # three words, the last one partly past the vocabulary
    allowed = {0, 5, 31, 32, 63, 64, 69}
    mask = torch.zeros(3, dtype=torch.int32)
    for t in allowed:
        mask[t // 32] |= torch.tensor(1 << (t % 32), dtype=torch.int64).to(torch.int32)  # bit 31: a negative word
    logits = torch.arange(vocab, dtype=torch.bfloat16)
    out = apply_mask(logits, mask)
    assert out.dtype == torch.bfloat16
    assert {i for i in range(vocab) if torch.isfinite(out[i])} == allowed
    assert torch.equal(out[sorted(allowed)], logits[sorted(allowed)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [70, 49152])
def test_the_cpu_kernel_masks_the_same_tokens_as_torch(dtype, vocab):
    """pointwise.c mask_logits (the cpu backend's mask_logits_) against apply_mask, with words
    all set, all clear and mixed."""
    from conftest import require_kernels
    from pdserve.engine.cpu import ops

    require_kernels("pointwise")
    g = torch.Generator().manual_seed(vocab)
    mask = torch.randint(-2**31, 2**31 - 1, ((vocab + 31) // 32,), dtype=torch.int32, generator=g)
    mask[::3], mask[1::5] = -1, 0
    logits = torch.randn(vocab, generator=g).to(dtype)
    want = apply_mask(logits, mask)
    assert torch.equal(ops.mask_logits_(logits.clone(), mask), want)


def test_min_tokens_does_not_ban_the_only_token_a_finished_grammar_allows(real):
    """The choice is done after one token, min_tokens asks for more: EOS is the only token the
    mask leaves, so it is drawn, and the grammar's end stops the request."""
    _, tokenizer, _ = real
    engine = engine_for(real)
    seq = request(tokenizer, "m", "Yes or no?", StructuredOutput("choice", choices=("yes", "no")), max_tokens=10, min_tokens=5)
    engine.add(seq)
    run_to_completion(engine)
    assert seq.finish_reason == "stop" and tokenizer.decode(seq.token_ids[seq.num_prompt_tokens:-1]) in ("yes", "no")
    assert_all_blocks_free(engine)


# -- batch invariance of constrained requests ---------------------------------------------

NEEDLE_TEXT = "Describe a person as JSON."
OTHERS = ["Tell me about the sea.", "List three fruits.", "What is 2+2?", "Write a haiku about rain.", "Name a planet.",
          "Describe a cat as JSON.", "Give a phone number.", "Say hello."]


def needle(tokenizer, **kw) -> Sequence:
    return request(tokenizer, "needle", NEEDLE_TEXT, PERSON_SO, **kw)


def neighbours(tokenizer, seed: int) -> list[Sequence]:
    """Unconstrained requests and ones with other constraints, greedy and seeded."""
    rng = random.Random(seed)
    kinds = [None, None, StructuredOutput("json_object"), StructuredOutput("regex", r"\d{3}-\d{4}"), PERSON_SO]
    return [request(tokenizer, f"n{i}", text, rng.choice(kinds), max_tokens=rng.randint(5, 30),
                    **({"temperature": 0.8, "seed": i} if i % 3 == 0 else {})) for i, text in enumerate(OTHERS)]


@pytest.fixture(scope="module")
def alone(real):
    engine = engine_for(real)
    seq = needle(real[1])
    engine.add(seq)
    run_to_completion(engine)
    assert seq.finish_reason == "stop"
    return outputs(seq)


@pytest.mark.parametrize("seed", [1, 2])
def test_a_constrained_needle_is_the_same_bits_anywhere_in_a_mixed_batch(real, alone, seed):
    tokenizer = real[1]
    engine = engine_for(real)
    others = neighbours(tokenizer, seed)
    where = random.Random(seed).randrange(len(others) + 1)
    seqs = [*others[:where], needle(tokenizer), *others[where:]]
    for seq in seqs:
        engine.add(seq)
    run_to_completion(engine)
    assert outputs(seqs[where]) == alone
    assert_all_blocks_free(engine)


def test_a_constrained_needle_preempted_and_recomputed_is_the_same_bits(real, alone):
    tokenizer = real[1]
    engine = engine_for(real, num_blocks=12, block_size=16)  # 192 slots for ~9 x 45 tokens: preemption
    seqs = [needle(tokenizer), *neighbours(tokenizer, 3)]
    for seq in seqs:
        engine.add(seq)
    run_to_completion(engine)
    assert engine.scheduler.num_preemptions > 0
    assert outputs(seqs[0]) == alone
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("resume_after", [1, 6])
def test_a_constrained_needle_migrated_mid_stream_is_the_same_bits(real, alone, resume_after):
    """Another replica recomputes prompt + the tokens streamed so far; its matcher accepts those
    tokens first (Engine.prepare), so the rest is what one process makes."""
    tokenizer = real[1]
    prompt = chat(tokenizer, NEEDLE_TEXT)
    seq = Sequence("moved", [*prompt, *(t for t, _, _ in alone[:resume_after])], len(prompt), needle(tokenizer).params)
    engine = engine_for(real)
    engine.add(seq)
    run_to_completion(engine)
    assert outputs(seq) == alone[resume_after:]
    assert_all_blocks_free(engine)


def test_a_constrained_needle_handed_from_prefill_to_decode_is_the_same_bits(real, alone):
    """Prefill samples token 1 under the mask; decode's matcher accepts it before its first step."""
    tokenizer = real[1]
    prefill, decode = engine_for(real), engine_for(real)
    first = needle(tokenizer, max_tokens=40)
    first.stop_after_first_token = True
    prefill.add(first)
    run_to_completion(prefill)
    n = first.num_prompt_tokens
    blocks = decode.reserve(n)
    src = torch.tensor(first.block_table[: len(blocks)], dtype=torch.long)
    for layer in range(decode.kv_spec.num_layers):
        k, v = prefill.kv_cache.read_blocks(layer, src)
        decode.kv_cache.write_blocks(layer, torch.tensor(blocks, dtype=torch.long), k, v)
    prefill.free_blocks(first.block_table)
    seq = Sequence("d", list(first.token_ids), n, first.params, num_computed_tokens=n, block_table=blocks)
    seq.logprobs = list(first.logprobs)
    decode.add(seq)
    run_to_completion(decode)
    assert outputs(seq) == alone
    assert_all_blocks_free(prefill)
    assert_all_blocks_free(decode)
