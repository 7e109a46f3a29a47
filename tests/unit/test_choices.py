"""n > 1: one prefill, the prompt's KV blocks forked copy-on-write into n choices in decode.

Choice i must be, bit for bit (ids and logprobs), the lone request with ``params.fork(i)``
(n = 1, seed + i), whether prefill hands it off, decode prefills it itself (colocated), or
it migrates; and every block and lease is back at baseline after it, and after a cancel.
"""

import asyncio

import pytest
from decode_worker.server import DecodeServer
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.engine import Engine, EngineConfig
from pdserve.engine.sequence import Sequence
from pdserve.errors import InvalidRequestError
from pdserve.messages import ChoiceState, FreshRequest, Migrated, PrefillRequest, TokenChunk, WithKV
from pdserve.model_loader import load_model, load_tokenizer
from pdserve.sampling import SamplingParams
from prefill_worker.server import PrefillServer
from test_engine import assert_all_blocks_free, run_to_completion
from test_workers import config, settle

N = 4
PARAMS = SamplingParams(max_tokens=12, temperature=0.9, top_k=50, seed=7, logprobs=3, ignore_eos=True, n=N)


def lone_outputs(seq: Sequence) -> tuple[list[int], list]:
    return seq.token_ids[seq.num_prompt_tokens:], [(lp.token_id, lp.logprob, list(lp.top)) for lp in seq.logprobs]


def chunk_outputs(chunks) -> dict[int, tuple[list[int], list, str]]:
    """{choice index: (ids, logprobs, finish reason)} from a stream of TokenChunk."""
    out: dict[int, tuple[list[int], list, str]] = {}
    for c in chunks:
        ids, lps, _ = out.get(c.index, ([], [], None))
        out[c.index] = ([*ids, *c.token_ids], [*lps, *((lp.token_id, lp.logprob, list(lp.top)) for lp in c.logprobs or ())], c.finish_reason)
    return out


def test_sampling_params_fork_gives_choice_i_seed_plus_i_and_n_checks():
    assert PARAMS.fork(0).seed == 7 and PARAMS.fork(3).seed == 10 and PARAMS.fork(3).n == 1
    assert SamplingParams(n=3).fork(2).seed is None
    with pytest.raises(InvalidRequestError, match="n must be in"):
        SamplingParams(n=0).validate(4, 100)
    with pytest.raises(InvalidRequestError, match="n must be in"):
        SamplingParams(n=65).validate(4, 100)
    with pytest.raises(InvalidRequestError, match="seed must be in"):
        SamplingParams(n=4, seed=2**63 - 2).validate(4, 100)


@pytest.mark.parametrize("num_tokens", [32, 35])
def test_block_fork_shares_full_blocks_and_copies_a_partial_last_one(num_tokens):
    bm = BlockManager(16, 16)
    table = bm.allocate_blocks(bm.num_blocks_for(num_tokens))
    tables, copies = bm.fork(table, num_tokens, 3)
    assert tables[0] is table
    partial = num_tokens % 16 != 0
    assert len(copies) == (2 if partial else 0)
    for t in tables[1:]:
        assert t[:2] == table[:2] and (t[2] != table[2] if partial else len(t) == 2)
    assert [bm.blocks[b].ref_count for b in table[:2]] == [3, 3]
    for t in tables:
        bm.free_blocks(t)
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)
    full = BlockManager(3, 16)
    assert full.fork(full.allocate_blocks(3), 35, 3) is None and all(b.ref_count == 1 for b in full.blocks)  # no room for the copies: nothing taken


@pytest.fixture(scope="module")
def real(real_model_dir):
    model, tokenizer = load_model(real_model_dir, "float32"), load_tokenizer(real_model_dir)
    prompt = tokenizer("Once upon a time, in a small village by the sea, there lived", return_tensors=None)["input_ids"]
    return model, prompt


@pytest.fixture(scope="module")
def alone(real):
    """Each choice run as its own request, n = 1 with seed + i."""
    model, prompt = real
    engine = Engine(model, EngineConfig(num_blocks=64), frozenset(), 1024)
    seqs = [Sequence(f"alone{i}", list(prompt), len(prompt), PARAMS.fork(i)) for i in range(N)]
    for seq in seqs:
        engine.add(seq)
    run_to_completion(engine)
    return {i: lone_outputs(seq) for i, seq in enumerate(seqs)}


def test_engine_forks_after_drawing_every_choices_first_token(real, alone):
    model, prompt = real
    engine = Engine(model, EngineConfig(num_blocks=64, block_size=16), frozenset(), 1024)
    parent = Sequence("p", list(prompt), len(prompt), PARAMS, stop_after_first_token=True)
    engine.add(parent)
    run_to_completion(engine)
    assert [c.index for c in parent.choices] == list(range(N)) and parent.finish_reason is None
    tables = engine.fork(parent.block_table, len(prompt), N)
    assert engine.block_manager.num_free_blocks == 64 - len(parent.block_table) - (N - 1) * (len(prompt) % 16 != 0)
    kids = [Sequence("p", [*prompt, c.token_id], len(prompt), PARAMS.fork(c.index), num_computed_tokens=len(prompt), block_table=t, index=c.index)
            for c, t in zip(parent.choices, tables)]
    for kid, c in zip(kids, parent.choices):
        kid.logprobs.append(c.logprob)
        engine.add(kid)
    run_to_completion(engine)
    assert {k.index: lone_outputs(k) for k in kids} == alone
    assert len({tuple(lone_outputs(k)[0]) for k in kids}) > 1  # seeds differ: the draws do (12 tokens each)
    assert_all_blocks_free(engine)


def test_n_above_1_must_stop_at_its_first_tokens(real):
    model, prompt = real
    engine = Engine(model, EngineConfig(num_blocks=64), frozenset(), 1024)
    engine.add(Sequence("x", list(prompt), len(prompt), PARAMS))
    with pytest.raises(ValueError, match="n > 1 stops at its first tokens"):
        run_to_completion(engine)


@pytest.fixture(scope="module")
def workers():
    prefill, decode = PrefillServer(config("grpc")), DecodeServer(config("grpc"))
    yield prefill, decode
    prefill.__del__()
    decode.__del__()


def test_disaggregated_choices_equal_each_lone_request_and_free_everything(workers, real, alone):
    prefill, decode = workers
    _, prompt = real

    async def go():
        first = await prefill.prefill(PrefillRequest("dis", prompt, PARAMS))
        chunks = [TokenChunk([c.token_id], c.finish_reason, [c.logprob], c.index) for c in first.choices]
        going = tuple(ChoiceState(c.index, (c.token_id,)) for c in first.choices if c.finish_reason is None)
        async for chunk in decode.generate(WithKV("dis", prompt, PARAMS, going[0].streamed[0], first.kv, choices=going)):
            chunks.append(chunk)
        return chunks, await decode.stats()

    chunks, during = asyncio.run(go())
    got = chunk_outputs(chunks)
    assert {i: got[i][:2] for i in got} == alone
    assert all(got[i][2] == "length" for i in got)
    assert during["num_kv_fetched"] >= 1
    p, d = asyncio.run(settle(prefill, decode))
    assert p["num_held"] == 0 and p["num_free_blocks"] == p["num_blocks"] and d["num_free_blocks"] == d["num_blocks"]


def test_colocated_choices_prefill_once_and_equal_each_lone_request(workers, real, alone):
    _, decode = workers
    _, prompt = real

    async def go():
        before = (await decode.stats())["num_tokens_computed"]
        chunks = [c async for c in decode.generate(FreshRequest("col", prompt, PARAMS))]
        return chunks, (await decode.stats())["num_tokens_computed"] - before

    chunks, computed = asyncio.run(go())
    got = chunk_outputs(chunks)
    assert {i: got[i][:2] for i in got} == alone
    # the prompt once, then each choice's tokens after its first (the last token's KV is never computed)
    assert computed == len(prompt) + N * (PARAMS.max_tokens - 1)


def test_migrated_choices_go_on_after_what_each_streamed(workers, real, alone):
    _, decode = workers
    _, prompt = real
    streamed = (ChoiceState(0, tuple(alone[0][0][:5])), ChoiceState(2, tuple(alone[2][0][:1])), ChoiceState(3, ()))

    async def go():
        return [c async for c in decode.generate(Migrated("mig", prompt, PARAMS, (), choices=streamed))]

    got = chunk_outputs(asyncio.run(go()))
    assert sorted(got) == [0, 2, 3]
    assert got[0][0] == alone[0][0][5:] and got[2][0] == alone[2][0][1:] and got[3][0] == alone[3][0]
    assert got[0][1] == alone[0][1][5:] and got[3][1] == alone[3][1]


@pytest.mark.parametrize("how", ["close", "abort"])
def test_a_cancelled_n_request_frees_every_fork(workers, real, how):
    prefill, decode = workers
    _, prompt = real
    params = SamplingParams(max_tokens=400, temperature=1.0, seed=1, ignore_eos=True, n=N)

    async def go():
        first = await prefill.prefill(PrefillRequest(f"cancel-{how}", prompt, params))
        going = tuple(ChoiceState(c.index, (c.token_id,)) for c in first.choices)
        stream = decode.generate(WithKV(f"cancel-{how}", prompt, params, going[0].streamed[0], first.kv, choices=going))
        seen = set()
        async for chunk in stream:
            seen.add(chunk.index)
            if len(seen) == N:
                break
        mid = await decode.stats()
        if how == "abort":
            assert await decode.abort(f"cancel-{how}")
            rest = [c async for c in stream]
            assert rest[-1].finish_reason == "abort"
        await stream.aclose()
        return mid

    mid = asyncio.run(go())
    assert mid["num_running"] == N
    p, d = asyncio.run(settle(prefill, decode))
    assert p["num_held"] == 0 and p["num_free_blocks"] == p["num_blocks"] and d["num_free_blocks"] == d["num_blocks"]
    assert d["num_running"] == 0


def test_forks_preempted_and_recomputed_equal_each_lone_request(real, alone):
    """A pool too small for every fork at once: forks are preempted (their shared blocks lose a
    reference, the prompt's stay with the others) and recompute prompt + tokens alone."""
    model, prompt = real
    engine = Engine(model, EngineConfig(num_blocks=2 + 2 * N, block_size=16), frozenset(), 1024)
    parent = Sequence("p", list(prompt), len(prompt), PARAMS, stop_after_first_token=True)
    engine.add(parent)
    run_to_completion(engine)
    tables = engine.fork(parent.block_table, len(prompt), N)
    kids = [Sequence("p", [*prompt, c.token_id], len(prompt), PARAMS.fork(c.index), num_computed_tokens=len(prompt), block_table=t, index=c.index)
            for c, t in zip(parent.choices, tables)]
    others = [Sequence(f"o{i}", list(prompt[i:]), len(prompt) - i, SamplingParams(max_tokens=30, ignore_eos=True)) for i in range(3)]
    for kid, c in zip(kids, parent.choices):
        kid.logprobs.append(c.logprob)
    for seq in [*kids, *others]:
        engine.add(seq)
    run_to_completion(engine)
    assert engine.scheduler.num_preemptions > 0
    assert {k.index: lone_outputs(k) for k in kids} == alone
    assert_all_blocks_free(engine)


def test_constrained_choices_follow_the_grammar_each_as_alone(workers, real, real_model_dir):
    """A JSON-object constraint with n = 3, colocated: the first tokens are drawn under one mask,
    and each fork's matcher accepts its own tokens (Engine.prepare) before its first step."""
    import json

    from pdserve.structured import StructuredOutput

    _, decode = workers
    _, prompt = real
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=11, structured=StructuredOutput("json_object"), n=3)

    async def go():
        together = [c async for c in decode.generate(FreshRequest("json-n", prompt, params))]
        lone = {i: [c async for c in decode.generate(FreshRequest(f"json-{i}", prompt, params.fork(i)))] for i in range(3)}
        return together, lone

    together, lone = asyncio.run(go())
    got = chunk_outputs(together)
    assert {i: got[i][0] for i in got} == {i: chunk_outputs(lone[i])[0][0] for i in range(3)}
    tokenizer = load_tokenizer(real_model_dir)
    ended = [ids for ids, _, reason in got.values() if reason == "stop"]
    assert ended and all(isinstance(json.loads(tokenizer.decode(ids)), dict) for ids in ended)


@pytest.mark.parametrize("after", [1, N + 2])
def test_a_colocated_n_request_closed_at_its_first_tokens_or_later_frees_every_block(workers, real, after):
    """Closed while the first tokens (drawn here) go out, or once the forks decode."""
    prefill, decode = workers
    _, prompt = real
    params = SamplingParams(max_tokens=200, temperature=1.0, seed=2, ignore_eos=True, n=N)

    async def go():
        stream = decode.generate(FreshRequest(f"close-{after}", prompt, params))
        count = 0
        async for _ in stream:
            count += 1
            if count == after:
                break
        await stream.aclose()

    asyncio.run(go())
    _, d = asyncio.run(settle(prefill, decode))
    assert d["num_free_blocks"] == d["num_blocks"] and d["num_running"] == 0
