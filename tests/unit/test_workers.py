"""The prefill and decode worker classes (no Ray Serve), on the real model in float32,
over each KV backend: the hand-off, its fault policy (recompute / fail), and that every
block and lease is back at baseline afterwards."""

import asyncio

import pytest

from conftest import NO_COMPILER, reference_generate
from decode_worker.server import DecodeServer, merge_chunks
from kv_transfer import shm_backend
from pdserve.engine import cpu
from pdserve.errors import KVIncompatibleError, KVTransferError
from pdserve.messages import LayerwiseKV, PrefillRequest, PrefillResult, PrefillStarted, TokenChunk, WithKV
from pdserve.model_loader import load_model, load_tokenizer
from pdserve.sampling import SamplingParams
from prefill_worker.server import PrefillServer

BACKENDS = ["grpc", pytest.param("shm", marks=pytest.mark.skipif(cpu.compiler() is None, reason=NO_COMPILER)), "auto"]
POOL = {"kv_cache_tokens": 2048, "block_size": 16}


def config(backend: str, **kv) -> dict:
    return {"model": {"path": "smollm2", "dtype": "float32", "max_model_len": 1024}, "prefill": {**POOL, "kv_lease_s": 30},
            "decode": POOL, "kv_transfer": {"backend": backend, "bind_host": "127.0.0.1", "timeout_s": 2.0, **kv}}


@pytest.fixture(scope="module")
def reference(real_model_dir):
    model, tokenizer = load_model(real_model_dir, "float32"), load_tokenizer(real_model_dir)
    prompt = tokenizer("The three primary colours are", return_tensors=None)["input_ids"]
    return prompt, reference_generate(model, prompt, 8, ignore_eos=True)


@pytest.fixture(scope="module", params=BACKENDS)
def workers(request):
    prefill, decode = PrefillServer(config(request.param)), DecodeServer(config(request.param))
    yield request.param, prefill, decode
    prefill.__del__()
    decode.__del__()


async def run(prefill: PrefillServer, decode: DecodeServer, prompt: list[int], request_id: str) -> list[int]:
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    first = await prefill.prefill(PrefillRequest(request_id, prompt, params))
    tokens = [first.first_token]
    async for chunk in decode.generate(WithKV(request_id, prompt, params, first.first_token, first.kv)):
        tokens.extend(chunk.token_ids)
    return tokens


async def settle(prefill: PrefillServer, decode: DecodeServer) -> tuple[dict, dict]:
    for _ in range(300):
        p, d = await prefill.stats(), await decode.stats()
        if p["num_held"] == 0 and p["num_free_blocks"] == p["num_blocks"] and d["num_free_blocks"] == d["num_blocks"]:
            break
        await asyncio.sleep(0.02)
    return p, d


def test_hand_off_is_exact_over_each_backend(workers, reference):
    backend, prefill, decode = workers
    prompt, want = reference
    assert asyncio.run(run(prefill, decode, prompt, f"ok-{backend}")) == want
    p, d = asyncio.run(settle(prefill, decode))
    assert p["num_held"] == 0 and p["num_free_blocks"] == p["num_blocks"] and d["num_free_blocks"] == d["num_blocks"]
    # auto: same node, so shm (grpc where shm's C block copy could not be built)
    used = {"grpc": "grpc", "shm": "shm", "auto": "shm" if shm_backend.available() else "grpc"}[backend]
    assert d[f"kv_num_fetched_{used}"] >= 1
    assert (prefill.engine.kv_cache.shm_path is not None) == (used == "shm")


def test_abort_by_id_stops_a_running_request_and_one_that_comes_later(workers, reference):
    """The router's abort by id, sent beside a cancel that Ray Serve may lose: a request
    decoding here ends at once (finish_reason "abort"); one aborted before its generate call
    comes returns without decoding. Both leave every block and lease free."""
    backend, prefill, decode = workers
    prompt, _ = reference
    params = SamplingParams(max_tokens=500, ignore_eos=True)

    async def go():
        first = await prefill.prefill(PrefillRequest(f"abort-{backend}", prompt, params))
        chunks = []
        async for chunk in decode.generate(WithKV(f"abort-{backend}", prompt, params, first.first_token, first.kv)):
            chunks.append(chunk)
            if len(chunks) == 3:
                assert await decode.abort(f"abort-{backend}")
        assert not await decode.abort(f"early-{backend}")  # not here yet: remembered
        second = await prefill.prefill(PrefillRequest(f"early-{backend}", prompt, params))
        late = [c async for c in decode.generate(WithKV(f"early-{backend}", prompt, params, second.first_token, second.kv))]
        assert await prefill.release(second.kv.transfer_id)  # as the router does for a request it gave up
        return chunks, late

    before = asyncio.run(decode.stats())["num_aborted_by_id"]
    chunks, late = asyncio.run(go())
    # aborted after 17 tokens (1 + 8 + 8: decode.stream_interval 8): at most the tokens held then follow
    assert chunks[-1].finish_reason == "abort" and sum(len(c.token_ids) for c in chunks) < 17 + 2 * 8, chunks
    assert late == []
    p, d = asyncio.run(settle(prefill, decode))
    assert p["num_held"] == 0 and p["num_free_blocks"] == p["num_blocks"] and d["num_free_blocks"] == d["num_blocks"]
    assert d["num_running"] == 0 and d["num_aborted_by_id"] == before + 1


def test_tokens_go_to_the_router_stream_interval_at_a_time(workers, reference):
    """decode.stream_interval (8 by default): after the first, each message holds 8 tokens,
    the last one the rest; logprobs come one per token, in order, as when sent one by one."""
    backend, prefill, decode = workers
    prompt, _ = reference
    params = SamplingParams(max_tokens=20, ignore_eos=True, logprobs=2)

    async def go():
        first = await prefill.prefill(PrefillRequest(f"interval-{backend}", prompt, params))
        return [c async for c in decode.generate(WithKV(f"interval-{backend}", prompt, params, first.first_token, first.kv))]

    chunks = asyncio.run(go())
    assert decode.pool_cfg.stream_interval == 8
    assert [len(c.token_ids) for c in chunks] == [1, 8, 8, 2] and [c.finish_reason for c in chunks] == [None, None, None, "length"]
    assert [len(c.logprobs) for c in chunks] == [1, 8, 8, 2]
    assert all(lp.token_id == t for c in chunks for lp, t in zip(c.logprobs, c.token_ids))
    asyncio.run(settle(prefill, decode))


def test_a_full_decode_pool_refuses_within_max_kv_wait_s_and_names_why(workers, reference, monkeypatch):
    """decode.max_kv_wait_s (1 s): a prompt's KV that finds no room is refused with
    CapacityError (429 / RESOURCE_EXHAUSTED) soon, not held until the KV deadline
    (kv_transfer.timeout_s, 2 s here); the message says how full the pool is. Nothing leaks.
    On a fake clock (decode_worker/server.py's ``time.monotonic``) that each reserve attempt
    moves 0.25 s: refused after the 5th attempt, once the clock is past 1 s (under the KV
    deadline it would be the 9th)."""
    import time
    import types

    from decode_worker import server
    from pdserve.errors import CapacityError

    backend, prefill, decode = workers
    prompt, _ = reference
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    assert decode.pool_cfg.max_kv_wait_s == 1.0 and decode.cfg.kv_transfer.timeout_s == 2.0
    taken = decode.engine.reserve(decode.engine.config.num_blocks * decode.engine.config.block_size)  # the whole pool
    now, attempts = [1000.0], []
    monkeypatch.setattr(server, "time", types.SimpleNamespace(monotonic=lambda: now[0], perf_counter=time.perf_counter))
    reserve = decode.engine.reserve

    def attempt(num_tokens):
        attempts.append(now[0])
        now[0] += 0.25
        return reserve(num_tokens)

    monkeypatch.setattr(decode.engine, "reserve", attempt)

    async def go():
        first = await prefill.prefill(PrefillRequest(f"full-{backend}", prompt, params))
        try:
            with pytest.raises(CapacityError, match=r"decode KV pool has no room for \d+ tokens after 1 s \(decode.max_kv_wait_s; 0 of \d+ blocks free"):
                async for _ in decode.generate(WithKV(f"full-{backend}", prompt, params, first.first_token, first.kv)):
                    pass
        finally:
            await prefill.release(first.kv.transfer_id)

    try:
        asyncio.run(go())
    finally:
        monkeypatch.undo()
        decode.engine.free_blocks(taken)
    assert attempts == [1000.0, 1000.25, 1000.5, 1000.75, 1001.0]  # until past the deadline of 1000.0 + max_kv_wait_s
    p, d = asyncio.run(settle(prefill, decode))
    assert p["num_held"] == 0 and p["num_free_blocks"] == p["num_blocks"] and d["num_free_blocks"] == d["num_blocks"]


def test_merged_chunks_keep_order_and_the_last_finish_reason():
    a, b = TokenChunk([1, 2], None, None), TokenChunk([3], "stop", None)
    assert merge_chunks(a, b) == TokenChunk([1, 2, 3], "stop", None)
    assert merge_chunks(TokenChunk([5], None, None), TokenChunk([], "abort", None)) == TokenChunk([5], "abort", None)


@pytest.mark.parametrize("fault", ["timeout", "break", "corrupt", "expire"])
@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_fault_policy(workers, reference, fault, policy):
    """recompute: the decode worker prefills the prompt itself and the answer is still
    exact; fail: the request fails with a KV transfer error. Nothing leaks either way."""
    backend, prefill, decode = workers
    prompt, want = reference
    decode.cfg.kv_transfer.on_fault = policy
    prefill.kv_sender.faults.stall_s = 3.0  # past the 2 s fetch deadline
    before = (asyncio.run(decode.stats()))["num_kv_faults"]
    prefill.kv_sender.faults.arm(fault)
    if fault == "expire":  # the lease is put expired; give the reaper its 0.5 s turn
        prefill.cfg.prefill.kv_lease_s, lease = 0.001, prefill.cfg.prefill.kv_lease_s
    try:
        if policy == "recompute":
            assert asyncio.run(run(prefill, decode, prompt, f"{fault}-{policy}-{backend}")) == want
        else:
            with pytest.raises(KVTransferError):
                asyncio.run(run(prefill, decode, prompt, f"{fault}-{policy}-{backend}"))
    finally:
        if fault == "expire":
            prefill.cfg.prefill.kv_lease_s = lease
        decode.cfg.kv_transfer.on_fault = "recompute"
    p, d = asyncio.run(settle(prefill, decode))
    assert d["num_kv_faults"] == before + 1
    assert p["num_held"] == 0 and p["num_free_blocks"] == p["num_blocks"]
    assert d["num_free_blocks"] == d["num_blocks"]


def test_incompatible_workers_fail_even_under_recompute(workers, reference):
    backend, prefill, decode = workers
    prompt, _ = reference
    fp = prefill.kv_sender.fingerprint
    prefill.kv_sender.fingerprint = type(fp)(**{**fp.to_dict(), "tokenizer_hash": "0" * 32})
    prefill.kv_sender.instance_id += "-changed"  # as after a restart: decode handshakes again
    try:
        with pytest.raises(KVIncompatibleError, match="tokenizer_hash"):
            asyncio.run(run(prefill, decode, prompt, f"fp-{backend}"))
    finally:
        prefill.kv_sender.fingerprint = fp
    p, d = asyncio.run(settle(prefill, decode))
    assert p["num_held"] == 0 and d["num_free_blocks"] == d["num_blocks"]


def test_seeded_sampling_is_the_same_disaggregated_or_not(workers, reference, real_model_dir):
    """temperature > 0 with a seed: prefill samples token 1 and decode the rest, yet the
    tokens equal one engine doing it all (the random stream is keyed by seed and position)."""
    from pdserve.engine.sequence import Sequence
    from test_engine import run_to_completion

    backend, prefill, decode = workers
    prompt, _ = reference
    params = SamplingParams(max_tokens=8, temperature=1.0, top_k=50, seed=2024, ignore_eos=True)

    async def disaggregated():
        first = await prefill.prefill(PrefillRequest(f"seed-{backend}", prompt, params))
        tokens = [first.first_token]
        async for chunk in decode.generate(WithKV(f"seed-{backend}", prompt, params, first.first_token, first.kv)):
            tokens.extend(chunk.token_ids)
        return tokens

    got = asyncio.run(disaggregated())
    from pdserve.engine.engine import Engine, EngineConfig

    # one engine doing both phases, on the same weights
    model = load_model(real_model_dir, str(decode.engine.model.dtype).removeprefix("torch."))
    engine = Engine(model, EngineConfig(num_blocks=64), decode.engine.eos_token_ids, decode.engine.max_model_len)
    seq = Sequence("alone", list(prompt), len(prompt), params)
    engine.add(seq)
    run_to_completion(engine)
    assert got == seq.token_ids[len(prompt):] and len(set(got)) > 1


# -- layer-wise hand-off (kv_transfer.layerwise) --------------------------------------

async def run_layerwise(prefill: PrefillServer, decode: DecodeServer, prompt: list[int], request_id: str, max_tokens: int = 8):
    """As the router's layer-wise path: decode is called at PrefillStarted, without the
    first token, while prefill computes. Returns (tokens, the decode task's exception or None)."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    steps = prefill.prefill_layerwise(PrefillRequest(request_id, prompt, params))
    started = await steps.__anext__()
    assert isinstance(started, PrefillStarted) and started.kv.num_tokens == len(prompt)

    async def decode_all() -> list[int]:
        out = []
        async for chunk in decode.generate(LayerwiseKV(request_id, prompt, params, started.kv)):
            out.extend(chunk.token_ids)
        return out

    decoding = asyncio.ensure_future(decode_all())
    first = await steps.__anext__()
    assert isinstance(first, PrefillResult) and first.kv == started.kv
    await steps.aclose()
    return [first.first_token, *await decoding]


def test_layerwise_hand_off_is_exact_and_overlaps_prefill(workers, reference, monkeypatch):
    """Decode starts fetching while prefill computes; the answer equals the reference and
    every block and lease is back at baseline. Over grpc the first KV chunk lands before
    prefill has finished (shm waits for the end: no overlap)."""
    import time

    from kv_transfer.paged import PagedKVSink

    backend, prefill, decode = workers
    prompt, want = reference
    assert asyncio.run(run_layerwise(prefill, decode, prompt, f"lw-{backend}")) == want
    p, d = asyncio.run(settle(prefill, decode))
    assert p["num_held"] == 0 and p["num_free_blocks"] == p["num_blocks"] and d["num_free_blocks"] == d["num_blocks"]

    writes, original = [], PagedKVSink.write
    monkeypatch.setattr(PagedKVSink, "write", lambda self, *a: (writes.append(time.monotonic()), original(self, *a))[1])
    long_prompt = (prompt * 100)[:600]
    finished = []
    original_finish = prefill.engine.scheduler.finish
    monkeypatch.setattr(prefill.engine.scheduler, "finish", lambda seq, **kw: (finished.append(time.monotonic()), original_finish(seq, **kw))[1])
    tokens = asyncio.run(run_layerwise(prefill, decode, long_prompt, f"lw-long-{backend}", max_tokens=2))
    assert len(tokens) == 2 and finished
    if backend == "grpc":  # (shm copies block to block without the sink's write)
        assert writes and writes[0] < finished[0], "no KV arrived before prefill ended"
    asyncio.run(settle(prefill, decode))


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_layerwise_prefill_that_fails_mid_stream_frees_both_sides(workers, reference, policy):
    """Prefill is cancelled after decode started fetching: decode's fetch stops with a
    fault; without the first token it cannot recompute, so it asks for a resend
    (FirstTokenMissingError) or fails (on_fault: fail). Nothing leaks."""
    from pdserve.errors import FirstTokenMissingError

    backend, prefill, decode = workers
    prompt, _ = reference
    decode.cfg.kv_transfer.on_fault = policy
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    # a prompt of its own: an earlier case's blocks in the prefix cache would make this prefill
    # a few tokens long, done before the cancel
    long_prompt = [1000 + 10 * ["grpc", "shm", "auto"].index(backend) + (policy == "fail")] + (prompt * 100)[:599]

    async def scenario():
        steps = prefill.prefill_layerwise(PrefillRequest(f"lw-cancel-{policy}-{backend}", long_prompt, params))
        started = await steps.__anext__()

        async def decode_all():
            async for _ in decode.generate(LayerwiseKV(started.request_id, long_prompt, params, started.kv)):
                pass

        decoding = asyncio.ensure_future(decode_all())
        await asyncio.sleep(0.05)
        await steps.aclose()  # as Ray Serve does when the router cancels the prefill call
        with pytest.raises(FirstTokenMissingError if policy == "recompute" else KVTransferError):
            await decoding

    try:
        asyncio.run(scenario())
    finally:
        decode.cfg.kv_transfer.on_fault = "recompute"
    p, d = asyncio.run(settle(prefill, decode))
    assert p["num_held"] == 0 and p["num_free_blocks"] == p["num_blocks"]
    assert d["num_free_blocks"] == d["num_blocks"] and d["num_running"] == 0


def test_layerwise_request_that_prefill_finishes_is_not_a_fault(workers, reference):
    """Prefill ends the request at its first token (here max_tokens 1) while decode is
    already fetching: decode's stream ends empty, no KV fault is counted, nothing leaks."""
    backend, prefill, decode = workers
    prompt, _ = reference
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    long_prompt = (prompt * 100)[:600]
    faults = asyncio.run(decode.stats())["num_kv_faults"]

    async def scenario():
        steps = prefill.prefill_layerwise(PrefillRequest(f"lw-ended-{backend}", long_prompt, params))
        started = await steps.__anext__()

        async def decode_all() -> list[int]:
            return [t async for chunk in decode.generate(LayerwiseKV(started.request_id, long_prompt, params, started.kv))
                    for t in chunk.token_ids]

        decoding = asyncio.ensure_future(decode_all())
        first = await steps.__anext__()
        assert first.finish_reason == "length" and first.kv is None
        assert await decoding == []
        await steps.aclose()

    asyncio.run(scenario())
    p, d = asyncio.run(settle(prefill, decode))
    assert d["num_kv_faults"] == faults
    assert p["num_held"] == 0 and p["num_free_blocks"] == p["num_blocks"] and d["num_free_blocks"] == d["num_blocks"]


# -- a router replica that dies (pdserve/callers.py) ---------------------------------

def test_the_requests_of_a_router_that_died_are_stopped_in_both_pools(workers, reference):
    """A router replica dies with three requests out: one decoding, one whose prompt's KV is
    leased but not yet fetched, one in a layer-wise hand-off (decode fetching while prefill
    computes). Once its liveness probe says dead, both pools stop all three: the tasks
    running them are cancelled and every block and lease is back at baseline."""
    from pdserve.callers import Caller

    backend, prefill, decode = workers
    prompt, _ = reference
    alive = {"router": True}

    async def probe(caller, timeout_s):
        return alive[caller.actor_id]

    saved = [(w.callers.probe, w.callers.interval_s) for w in (prefill, decode)]
    for w in (prefill, decode):
        w.callers.probe, w.callers.interval_s = probe, 0.02
    router, params = Caller("router", None), SamplingParams(max_tokens=500, ignore_eos=True)
    salt = 1200 + 10 * ["grpc", "shm", "auto"].index(backend)  # prompts of their own: not cut short by the prefix cache
    lw_prompt = [salt] + (prompt * 100)[:599]
    before = (asyncio.run(prefill.stats())["num_stopped_for_dead_caller"], asyncio.run(decode.stats())["num_stopped_for_dead_caller"])

    async def scenario():
        first = await prefill.prefill(PrefillRequest(f"dead-decoding-{backend}", prompt, params, router))
        chunks = []

        async def stream():
            async for chunk in decode.generate(WithKV(first.request_id, prompt, params, first.first_token, first.kv, caller=router)):
                chunks.append(chunk)

        decoding = asyncio.ensure_future(stream())
        leased = await prefill.prefill(PrefillRequest(f"dead-leased-{backend}", [salt + 1, *prompt], params, router))
        assert leased.kv is not None
        items: asyncio.Queue = asyncio.Queue()

        async def drive_prefill():  # as Ray Serve drives a streaming call: one task for the whole generator
            async for item in prefill.prefill_layerwise(PrefillRequest(f"dead-lw-{backend}", lw_prompt, params, router)):
                await items.put(item)

        prefilling = asyncio.ensure_future(drive_prefill())
        started = await items.get()

        async def lw_stream():
            async for _ in decode.generate(LayerwiseKV(started.request_id, lw_prompt, params, started.kv, caller=router)):
                pass

        lw_decoding = asyncio.ensure_future(lw_stream())
        for _ in range(1000):  # a deadline that only catches a hang
            if len(chunks) >= 2:
                break
            await asyncio.sleep(0.01)
        alive["router"] = False
        outcomes = await asyncio.gather(decoding, prefilling, lw_decoding, return_exceptions=True)
        return chunks, outcomes

    try:
        chunks, outcomes = asyncio.run(scenario())
    finally:
        for w, (probe_was, interval_was) in zip((prefill, decode), saved):
            w.callers.probe, w.callers.interval_s = probe_was, interval_was
    # decoding: its task cancelled, or its stream ended first ("abort"); prefilling: its task cancelled
    assert isinstance(outcomes[0], asyncio.CancelledError) or (outcomes[0] is None and chunks[-1].finish_reason == "abort"), (outcomes, chunks[-1:])
    assert isinstance(outcomes[1], asyncio.CancelledError), outcomes
    assert sum(len(c.token_ids) for c in chunks) < 500  # stopped, not run on to max_tokens
    p, d = asyncio.run(settle(prefill, decode))
    assert p["num_held"] == 0 and p["num_free_blocks"] == p["num_blocks"] and p["num_running"] == 0
    assert d["num_free_blocks"] == d["num_blocks"] and d["num_running"] == 0
    assert p["num_stopped_for_dead_caller"] - before[0] == 3 and d["num_stopped_for_dead_caller"] - before[1] >= 1


def test_a_constrained_request_is_the_same_disaggregated_or_not(workers, reference, real_model_dir):
    """A JSON schema: prefill samples token 1 under its mask, and the decode replica's matcher
    accepts that token before its first step (Engine.prepare, on the worker's event loop): the
    ids equal one engine doing it all, and the output is the schema's JSON."""
    import json

    from pdserve.engine.engine import Engine, EngineConfig
    from pdserve.engine.sequence import Sequence
    from pdserve.structured import StructuredOutput
    from test_engine import run_to_completion

    backend, prefill, decode = workers
    tokenizer = load_tokenizer(real_model_dir)
    prompt = tokenizer("A person, as JSON:", return_tensors=None)["input_ids"]
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    params = SamplingParams(max_tokens=30, structured=StructuredOutput("json", json.dumps(schema)))

    async def disaggregated():
        first = await prefill.prefill(PrefillRequest(f"json-{backend}", prompt, params))
        tokens = [first.first_token]
        async for chunk in decode.generate(WithKV(f"json-{backend}", prompt, params, first.first_token, first.kv)):
            tokens.extend(chunk.token_ids)
            finish = chunk.finish_reason
        return tokens, finish

    got, finish = asyncio.run(disaggregated())
    engine = Engine(load_model(real_model_dir, "float32"), EngineConfig(num_blocks=64), decode.engine.eos_token_ids, decode.engine.max_model_len,
                    grammars=decode.engine.grammars)
    seq = Sequence("alone", list(prompt), len(prompt), params)
    engine.add(seq)
    run_to_completion(engine)
    assert finish == "stop" and got == seq.token_ids[len(prompt):-1]  # the EOS that ends it is not streamed
    assert set(json.loads(tokenizer.decode(got))) == {"name", "age"}
    p, d = asyncio.run(settle(prefill, decode))
    assert p["num_held"] == 0 and p["num_free_blocks"] == p["num_blocks"] and d["num_free_blocks"] == d["num_blocks"]
