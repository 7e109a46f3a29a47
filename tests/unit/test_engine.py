"""The shared engine on tiny random-weight models (Llama and Qwen2), against model.generate.

Every test ends by checking that all KV blocks are back in the pool.
"""

import asyncio
import os
import threading
import time

import pytest
import torch

from conftest import reference_generate, require_kernels, tiny_model
from pdserve.engine import allocator
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.engine import Engine, EngineConfig
from pdserve.engine.kv_cache import PagedKVCache
from pdserve.engine.loop import EngineLoop
from pdserve.engine.sequence import Sequence
from pdserve.errors import InvalidRequestError
from pdserve.kv_layout import KVSpec
from pdserve.sampling import SamplingParams

EOS = frozenset({2})
AVX512 = os.path.exists("/proc/cpuinfo") and " avx512f" in open("/proc/cpuinfo").read()


def random_prompts(lengths, seed=0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


def run_to_completion(engine: Engine, max_steps: int = 10_000) -> None:
    for _ in range(max_steps):
        if not engine.scheduler.has_work():
            return
        engine.step()
    raise AssertionError("engine did not finish")


def assert_all_blocks_free(engine: Engine) -> None:
    usage = engine.block_manager.usage()
    assert usage["num_free_blocks"] == usage["num_blocks"], usage
    assert all(b.ref_count == 0 for b in engine.block_manager.blocks)


async def until_idle(engine: Engine, timeout_s: float = 2.0) -> None:
    """Returns once the engine has no work (aborts are applied between steps), or at the deadline."""
    for _ in range(int(timeout_s / 0.01)):
        if not engine.scheduler.has_work():
            return
        await asyncio.sleep(0.01)


def generate_all(engine: Engine, prompts, max_tokens: int) -> list[Sequence]:
    seqs = [Sequence(f"r{i}", list(p), len(p), SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for i, p in enumerate(prompts)]
    for seq in seqs:
        engine.add(seq)
    run_to_completion(engine)
    return seqs


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_batched_chunked_prefill_and_decode_equal_generate(family):
    model, reference = tiny_model(family), tiny_model(family)
    engine = Engine(model, EngineConfig(num_blocks=128, block_size=4, max_num_batched_tokens=64, chunk_size=16), EOS, 512)
    prompts = random_prompts([1, 5, 16, 17, 40, 3, 64, 9])
    seqs = generate_all(engine, prompts, 12)
    for seq, prompt in zip(seqs, prompts):
        assert seq.token_ids[len(prompt):] == reference_generate(reference, prompt, 12, ignore_eos=True)
        assert seq.finish_reason == "length"
    assert engine.num_steps < 8 * 12  # sequences shared forwards
    assert_all_blocks_free(engine)


def test_a_cpu_step_runs_torch_on_one_thread_and_its_kernels_on_all(monkeypatch):
    """On the cpu backend a step's own torch ops (embedding, sampling) run on the step's
    thread alone, so torch's OpenMP workers never spin on the cores the kernels' pool needs;
    the kernels keep the engine's threads, and torch's setting is back after the step."""
    require_kernels("linear", "pointwise", "attention")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        engine = Engine(tiny_model("llama"), EngineConfig(num_blocks=32, block_size=4), EOS, 128)
        assert engine.backend.name == "cpu" and engine.backend.num_threads == 2
        seen = []
        forward = engine.runner.forward
        monkeypatch.setattr(engine.runner, "forward", lambda batch: seen.append(torch.get_num_threads()) or forward(batch))
        generate_all(engine, random_prompts([9, 4]), 3)
        assert seen and set(seen) == {1}
        assert torch.get_num_threads() == 2 and engine.backend.num_threads == 2
    finally:
        torch.set_num_threads(before)


def test_preemption_recomputes_and_still_equals_generate():
    model, reference = tiny_model("llama"), tiny_model("llama")
    # 20 blocks x 4 tokens = 80 slots for six sequences of up to 70 tokens each.
    engine = Engine(model, EngineConfig(num_blocks=20, block_size=4, max_num_batched_tokens=64, chunk_size=64), EOS, 512)
    prompts = random_prompts([30, 25, 40, 33, 20, 28], seed=1)
    seqs = generate_all(engine, prompts, 30)
    assert engine.scheduler.num_preemptions > 0
    for seq, prompt in zip(seqs, prompts):
        assert seq.token_ids[len(prompt):] == reference_generate(reference, prompt, 30, ignore_eos=True)
    assert_all_blocks_free(engine)


def test_prefix_cache_hit_is_reused_and_exact():
    model, reference = tiny_model("qwen2"), tiny_model("qwen2")
    engine = Engine(model, EngineConfig(num_blocks=64, block_size=4), EOS, 512)
    prompt = random_prompts([41])[0]
    want = reference_generate(reference, prompt, 8, ignore_eos=True)
    first = generate_all(engine, [prompt], 8)[0]
    second = generate_all(engine, [prompt], 8)[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 40  # 10 full blocks, last token recomputed
    assert first.token_ids[41:] == want and second.token_ids[41:] == want
    # a prompt sharing only the first 9 tokens hits the first 2 blocks
    other = prompt[:9] + random_prompts([20], seed=5)[0]
    third = generate_all(engine, [other], 4)[0]
    assert third.num_cached_tokens == 8
    assert third.token_ids[len(other):] == reference_generate(reference, other, 4, ignore_eos=True)
    assert_all_blocks_free(engine)


def test_prefix_hits_are_verified_against_token_ids():
    manager = BlockManager(num_blocks=8, block_size=2)
    seq = Sequence("a", [5, 6, 7, 8, 9], 5, SamplingParams())
    assert manager.ensure_slots(seq, 5)
    seq.num_computed_tokens = 5
    manager.mark_computed(seq, 0)
    manager.free(seq)
    # forge a colliding hash: the block registered for [5, 6] now claims other tokens
    block = manager.blocks[manager.hash_to_block_id[next(iter(manager.hash_to_block_id))]]
    block.token_ids = (1, 1)
    again = Sequence("b", [5, 6, 7, 8, 9], 5, SamplingParams())
    manager.allocate_prefix(again)
    assert again.num_cached_tokens == 0 and again.block_table == []


def test_request_that_can_never_fit_is_refused():
    engine = Engine(tiny_model("llama"), EngineConfig(num_blocks=4, block_size=4), EOS, 512)
    with pytest.raises(InvalidRequestError, match="KV pool of 16 tokens"):
        engine.add(Sequence("big", [3] * 10, 10, SamplingParams(max_tokens=10)))


def test_prefill_role_keeps_blocks_for_hand_off():
    engine = Engine(tiny_model("llama"), EngineConfig(num_blocks=16, block_size=4), EOS, 512)
    seq = Sequence("p", random_prompts([10])[0], 10, SamplingParams(max_tokens=5, ignore_eos=True), stop_after_first_token=True)
    engine.add(seq)
    run_to_completion(engine)
    assert seq.num_generated == 1 and len(seq.block_table) == 3  # 10 prompt tokens in 3 blocks of 4
    assert engine.block_manager.num_free_blocks == 13
    engine.free_blocks(seq.block_table)
    assert_all_blocks_free(engine)


def test_loop_streams_and_abort_frees_blocks():
    engine = Engine(tiny_model("llama"), EngineConfig(num_blocks=64, block_size=4), EOS, 512)
    loop = EngineLoop(engine)

    async def main():
        short = Sequence("short", random_prompts([7])[0], 7, SamplingParams(max_tokens=5, ignore_eos=True))
        long = Sequence("long", random_prompts([9], seed=2)[0], 9, SamplingParams(max_tokens=200, ignore_eos=True))
        short_queue, long_queue = loop.submit(short), loop.submit(long)
        chunks = []
        while not chunks or chunks[-1].finish_reason is None:
            chunks.append(await asyncio.wait_for(short_queue.get(), timeout=30))
        assert [t for c in chunks for t in c.token_ids] == short.token_ids[7:] and len(short.token_ids) == 12
        await asyncio.wait_for(long_queue.get(), timeout=30)
        loop.abort(long)
        await until_idle(engine)

    asyncio.run(main())
    loop.close()
    assert not engine.scheduler.has_work()
    assert_all_blocks_free(engine)


def test_loop_runs_the_engine_thread_at_its_niceness():
    """``engine_nice``: the engine thread alone gets it (the caller's thread keeps its own)."""
    engine = Engine(tiny_model("llama"), EngineConfig(num_blocks=64, block_size=4), EOS, 512)
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    loop = EngineLoop(engine, nice=mine + 3)
    try:
        async def main():
            seq = Sequence("n", random_prompts([7])[0], 7, SamplingParams(max_tokens=2, ignore_eos=True))
            queue = loop.submit(seq)
            while (await asyncio.wait_for(queue.get(), timeout=30)).finish_reason is None:
                pass

        asyncio.run(main())  # the thread has run a step: its niceness is set by now
        assert os.getpriority(os.PRIO_PROCESS, loop._thread.native_id) == mine + 3
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine
    finally:
        loop.close()
    assert_all_blocks_free(engine)


def test_the_loops_gate_brackets_every_step_on_its_thread_even_one_that_fails():
    """EngineLoop's ``gate`` (pdserve/core_share.py's CoreShare): before_step
    and after_step around each step, on the engine thread, after_step also when the step
    raises (a prefill word left busy would hold decode back); closed with the loop."""
    engine = Engine(tiny_model("llama"), EngineConfig(num_blocks=64, block_size=4), EOS, 512)
    calls = []

    class Gate:
        def before_step(self):
            calls.append(("before", threading.get_ident()))

        def after_step(self):
            calls.append(("after", threading.get_ident()))

        def close(self):
            calls.append(("close", None))

    loop = EngineLoop(engine, gate=Gate())
    real_step, failed = engine.step, []

    def step():
        if not failed:
            failed.append(True)
            raise RuntimeError("a failed forward")
        return real_step()

    engine.step = step

    async def main():
        for name in ("fails", "runs"):
            seq = Sequence(name, random_prompts([7])[0], 7, SamplingParams(max_tokens=3, ignore_eos=True))
            queue = loop.submit(seq)
            while True:
                item = await asyncio.wait_for(queue.get(), timeout=30)
                if isinstance(item, Exception) or item.finish_reason is not None:
                    break

    asyncio.run(main())
    loop.close(wait_s=30)
    kinds = [kind for kind, _ in calls]
    assert kinds[-1] == "close" and kinds[:-1] == ["before", "after"] * (len(kinds[:-1]) // 2) and len(kinds) >= 7
    assert {tid for _, tid in calls[:-1]} == {loop._thread.ident}
    assert_all_blocks_free(engine)


def test_a_gate_that_raises_is_dropped_and_the_engine_steps_on():
    """Taking turns is an optimisation: a gate whose before_step raises (a stray file in
    /dev/shm, say) is logged, closed and dropped, and the request is served."""
    engine = Engine(tiny_model("llama"), EngineConfig(num_blocks=64, block_size=4), EOS, 512)
    closed = []

    class Broken:
        def before_step(self):
            raise PermissionError("not ours")

        def after_step(self):
            pass

        def close(self):
            closed.append(True)

    loop = EngineLoop(engine, gate=Broken())

    async def main():
        seq = Sequence("g", random_prompts([7])[0], 7, SamplingParams(max_tokens=3, ignore_eos=True))
        queue = loop.submit(seq)
        tokens = []
        while True:
            chunk = await asyncio.wait_for(queue.get(), timeout=30)
            tokens += chunk.token_ids
            if chunk.finish_reason is not None:
                return tokens

    assert len(asyncio.run(main())) == 3
    assert closed == [True] and loop.gate is None
    loop.close(wait_s=30)
    assert_all_blocks_free(engine)


def test_submit_and_abort_never_wait_for_a_running_step():
    """The event loop queues requests and aborts for the engine thread: with the engine's lock
    held (as through a long prefill step) both return at once, and once the step ends the
    request runs, or is dropped, with every block back."""
    engine = Engine(tiny_model("llama"), EngineConfig(num_blocks=64, block_size=4), EOS, 512)
    loop = EngineLoop(engine)
    step_running, step_done = threading.Event(), threading.Event()

    def long_step():
        with engine.lock:
            step_running.set()
            step_done.wait(30)

    kept = Sequence("kept", random_prompts([7])[0], 7, SamplingParams(max_tokens=3, ignore_eos=True))
    dropped = Sequence("dropped", random_prompts([9], seed=2)[0], 9, SamplingParams(max_tokens=200, ignore_eos=True))

    async def main():
        holder = threading.Thread(target=long_step)
        holder.start()
        step_running.wait(30)
        kept_queue = loop.submit(kept)  # would block here until step_done if it took the lock
        loop.submit(dropped)
        loop.abort(dropped)
        assert holder.is_alive() and not engine.scheduler.has_work()  # nothing reached the engine yet
        step_done.set()
        holder.join()
        chunks = []
        while not chunks or chunks[-1].finish_reason is None:
            chunks.append(await asyncio.wait_for(kept_queue.get(), timeout=30))
        assert [t for c in chunks for t in c.token_ids] == kept.token_ids[7:] and len(kept.token_ids) == 10
        await until_idle(engine)

    asyncio.run(main())
    loop.close()
    assert not engine.scheduler.has_work() and dropped.num_generated == 0
    assert_all_blocks_free(engine)


def test_a_hung_step_fails_the_health_check_and_its_requests_and_a_live_loop_passes_it(monkeypatch):
    """On a fake clock (loop.py's ``time.monotonic``; its waits poll every 10 ms of real time):
    the step is stuck exactly max_step_s, then past it, with no wall-clock bound asserted."""
    import types

    from pdserve.engine import loop as loop_module
    from pdserve.errors import WorkerStalledError

    HANG_DEADLINE_S = 60.0  # real seconds: only catches a hang, never a pass/fail bound
    now = [1000.0]  # the fake clock the loop reads
    monkeypatch.setattr(loop_module, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    monkeypatch.setattr(loop_module, "STALL_POLL_S", 0.01)
    engine = Engine(tiny_model("llama"), EngineConfig(num_blocks=16, block_size=4), EOS, 512)
    loop = EngineLoop(engine, max_step_s=1.0)
    loop.check_health()  # idle: the loop comes round every 0.5 s at most
    step, entered, release = engine.step, threading.Event(), threading.Event()
    engine.step = lambda: (entered.set(), release.wait(HANG_DEADLINE_S), step())[-1]  # the next forward hangs until released
    polls = []  # the fake time of each stall check
    check = loop.raise_if_stalled
    loop.raise_if_stalled = lambda: (polls.append(now[0]), check())[-1]

    async def hang():
        seq = Sequence("h", random_prompts([5])[0], 5, SamplingParams(max_tokens=2, ignore_eos=True))
        queue = loop.submit(seq)
        assert await asyncio.to_thread(entered.wait, HANG_DEADLINE_S)  # the step began at fake 1000.0
        now[0] = 1001.0  # stuck exactly max_step_s: not yet stalled
        polls.clear()
        waiting = asyncio.create_task(loop.next_output(queue, timeout_s=30))
        for _ in range(int(HANG_DEADLINE_S / 0.01)):
            if len(polls) >= 3:
                break
            await asyncio.sleep(0.01)
        assert len(polls) >= 3 and not waiting.done()  # three stall checks passed while waiting
        assert loop.stalled_s() == 1.0
        loop.check_health()
        polls.clear()
        now[0] = 1002.0  # past max_step_s: its waiting request is told at its next check
        with pytest.raises(WorkerStalledError, match=r"^engine step stuck for 2 s \(over max_step_s 1 s\)$"):
            await asyncio.wait_for(waiting, HANG_DEADLINE_S)
        assert polls == [1002.0]
        with pytest.raises(WorkerStalledError):  # and a new one is refused
            loop.submit(Sequence("new", random_prompts([5])[0], 5, SamplingParams(max_tokens=2)))
        with pytest.raises(RuntimeError, match="engine step stuck"):  # Ray Serve's health check fails
            loop.check_health()
        loop.abort(seq)

    asyncio.run(hang())
    release.set()
    for _ in range(int(HANG_DEADLINE_S / 0.01)):  # the released step returns; later steps start at fake 1002.0
        if loop.stalled_s() == 0.0:
            break
        time.sleep(0.01)
    loop.check_health()
    loop.close()
    for _ in range(int(HANG_DEADLINE_S / 0.01)):
        if not loop.is_alive():
            break
        time.sleep(0.01)
    with pytest.raises(RuntimeError, match="engine thread has stopped"):
        loop.check_health()
    assert_all_blocks_free(engine)


def test_next_output_times_out_on_a_live_loop_without_calling_it_stalled():
    engine = Engine(tiny_model("llama"), EngineConfig(num_blocks=16, block_size=4), EOS, 512)
    loop = EngineLoop(engine, max_step_s=0.05)  # far below the idle loop's 0.5 s wake-up: idle time is not a stuck step

    async def wait():
        with pytest.raises(TimeoutError) as e:  # nothing was submitted to this queue: a plain deadline
            await loop.next_output(asyncio.Queue(), timeout_s=1.5, deadline_name="test deadline")
        assert type(e.value) is TimeoutError
        assert str(e.value) == "test deadline of 1.5 s passed with nothing from the engine (0 requests running, 0 waiting)"

    asyncio.run(wait())
    time.sleep(0.3)  # out of phase with the idle wake-ups
    assert loop.stalled_s() == 0.0
    loop.close()


def test_the_fault_injection_file_hangs_exactly_one_loop(tmp_path, monkeypatch):
    from pdserve.engine.loop import HANG_FILE_ENV

    trigger = tmp_path / "hang"
    monkeypatch.setenv(HANG_FILE_ENV, str(trigger))
    engines = [Engine(tiny_model("llama"), EngineConfig(num_blocks=16, block_size=4), EOS, 512) for _ in range(2)]
    loops = [EngineLoop(e, max_step_s=0.5) for e in engines]
    trigger.write_text("")

    async def run_both():
        seqs = [Sequence(f"s{i}", random_prompts([5])[0], 5, SamplingParams(max_tokens=3, ignore_eos=True)) for i in range(2)]
        queues = [loop.submit(s) for loop, s in zip(loops, seqs)]
        results = await asyncio.gather(*(loop.next_output(q, 10) for loop, q in zip(loops, queues)), return_exceptions=True)
        for loop, seq in zip(loops, seqs):
            loop.abort(seq)
        return results

    results = asyncio.run(run_both())
    assert sorted(type(r).__name__ for r in results) == ["TokenChunk", "WorkerStalledError"]
    assert not trigger.exists() and len(list(tmp_path.glob("hang.taken-by-*"))) == 1
    for loop in loops:
        loop.close()
    time.sleep(0.6)
    live = engines[[type(r).__name__ for r in results].index("TokenChunk")]
    assert_all_blocks_free(live)


def _kernels_or_skip():
    from pdserve.engine.cpu import ops

    require_kernels(*ops.KERNELS)
    return ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 32), (8, 2, 128), (6, 3, 24)])
@pytest.mark.parametrize("bs", [16, 5])
def test_paged_attention_kernel_matches_sdpa_and_is_row_invariant(dtype, heads, kv_heads, head_dim, bs):
    """The C attention kernel over scattered blocks: ragged contexts (1 token, partial blocks,
    1100), prompt chunks and decode rows in one call, GQA, a head_dim that is no multiple of
    the vector width, blocks that do not divide the kernels' key tiles. Within float32 (bf16)
    rounding of SDPA on the gathered context; each row bit for bit what it is alone, and the
    whole prompt what it is in chunks. bf16 with head_dim % 32 == 0 takes the AMX or
    AVX512-BF16 path where the CPU has one (``ops.isa``)."""
    check_paged_attention(dtype, heads, kv_heads, head_dim, bs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 32), (8, 2, 128)])
@pytest.mark.parametrize("bs", [16, 5])
def test_paged_attention_kernel_is_exact_and_row_invariant_when_the_max_grows_along_the_context(dtype, heads, kv_heads, head_dim, bs):
    """As above with keys of very different sizes: a row's max moves by tens of units as its
    keys go by, so the softmax's rescaling runs (lazily, on the AMX path: only past a margin)."""
    check_paged_attention(dtype, heads, kv_heads, head_dim, bs, spread=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (6, 3, 24), (8, 8, 16)])
@pytest.mark.parametrize("window,softcap", [(37, None), (16, None), (1, None), (None, 2.0), (100, 30.0)])
def test_paged_attention_kernel_with_a_window_or_soft_cap_matches_the_reference_and_is_row_invariant(dtype, heads, kv_heads, head_dim,
                                                                                                     window, softcap):
    """The same checks with a sliding window (row p sees keys max(0, p - window + 1)..p: a
    window shorter than a tile, one tile long, one token) and soft-capped scores (Gemma 2's
    ``cap * tanh(s / cap)``), against a float64 reference: every path (AVX512-BF16 where
    head_dim % 32 == 0 in bf16, the float32 one elsewhere) starts each row at the tile
    holding its first key, so a row is still the same bits alone, in chunks and in any batch."""
    check_paged_attention(dtype, heads, kv_heads, head_dim, 5, window, softcap)


def check_paged_attention(dtype, heads, kv_heads, head_dim, bs, window=None, softcap=None, spread=False):
    """spread: keys scaled 1-12x at random, so a row's running max grows by tens along its
    context (the AMX path's lazy rescaling of O)."""
    ops = _kernels_or_skip()
    torch.manual_seed(0)
    ctx = [1, 17, 1100, 40]
    new = [1, 5, 1, 40]  # decode rows, a chunk after cached tokens, a whole prompt
    num_blocks = sum(-(-n // bs) for n in ctx) + 3
    k = torch.randn(kv_heads, num_blocks * bs, head_dim)
    k = (k * (1 + 11 * torch.rand(1, num_blocks * bs, 1)) if spread else k).to(dtype)
    v = torch.randn(kv_heads, num_blocks * bs, head_dim).to(dtype)
    perm, tables, max_blocks = torch.randperm(num_blocks).tolist(), [], max(-(-n // bs) for n in ctx)
    for n in ctx:
        table, perm = perm[: -(-n // bs)], perm[-(-n // bs):]
        tables.append(table + [0] * (max_blocks - len(table)))
    tables_t = torch.tensor(tables, dtype=torch.int32)
    token_seq = torch.tensor([i for i, n in enumerate(new) for _ in range(n)], dtype=torch.int32)
    positions = torch.tensor([p for c, n in zip(ctx, new) for p in range(c - n, c)])
    q = (torch.randn(heads, len(positions), head_dim) * 3).to(dtype).transpose(0, 1)  # [T, heads, D], strided
    scale, opts = head_dim**-0.5, dict(window=window, softcap=softcap)
    got = ops.paged_attention(q, k, v, tables_t, token_seq, positions, bs, scale, **opts).view(-1, heads, head_dim)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    group = heads // kv_heads
    for t in range(len(positions)):
        s, p = token_seq[t].item(), positions[t].item()
        pos = torch.arange(max(0, p - window + 1) if window else 0, p + 1)
        slots = torch.tensor(tables[s])[pos // bs] * bs + pos % bs
        keys, values = k[:, slots].double().repeat_interleave(group, 0), v[:, slots].double().repeat_interleave(group, 0)  # [heads, n, D]
        scores = torch.einsum("hd,hnd->hn", q[t].double(), keys) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        want = torch.einsum("hn,hnd->hd", torch.softmax(scores, -1), values)
        torch.testing.assert_close(got[t].double(), want, **tol)
        alone = ops.paged_attention(q[t : t + 1], k, v, tables_t, token_seq[t : t + 1], positions[t : t + 1], bs, scale, **opts)
        assert torch.equal(alone.view(heads, head_dim), got[t]), t
    assert torch.equal(ops.paged_attention(q, k, v, tables_t, token_seq, positions, bs, scale, num_threads=2, **opts).view_as(got), got)
    prompt = torch.nonzero(token_seq == 3).flatten().tolist()  # the 40-token prompt in chunks of 7
    for c in range(0, len(prompt), 7):
        rows = prompt[c : c + 7]
        chunk = ops.paged_attention(q[rows], k, v, tables_t, token_seq[rows], positions[rows], bs, scale, **opts)
        assert torch.equal(chunk.view(-1, heads, head_dim), got[rows]), c


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_features,out_features,bias", [(576, 1536, False), (1536, 576, False), (131, 577, True), (64, 4, True)])
def test_linear_kernel_rows_are_the_same_bits_in_any_batch(dtype, in_features, out_features, bias):
    """The C linear layer: within rounding of torch's matmul, and each row the same bits alone,
    in batches of every size up to 70 (each tile shape and tail), at any offset, on 1 or 2
    threads; torch's own float32 matmul is not (the first assert shows the property is not
    trivial here)."""
    ops = _kernels_or_skip()
    torch.manual_seed(1)
    w, x = torch.randn(out_features, in_features).to(dtype), torch.randn(70, in_features).to(dtype)
    b = torch.randn(out_features).to(dtype) if bias else None
    packed = ops.pack(w)
    alone = torch.cat([ops.linear(x[i : i + 1], packed, out_features, b) for i in range(70)])
    want = (x.float() @ w.float().T + (b.float() if bias else 0))
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=0.3)
    torch.testing.assert_close(alone.float(), want, **tol)
    for m in range(2, 71):
        start = (m * 7) % (71 - m)
        assert torch.equal(ops.linear(x[start : start + m], packed, out_features, b), alone[start : start + m]), m
    assert torch.equal(ops.linear(x, packed, out_features, b, num_threads=2), alone)


def test_torch_float32_matmul_is_not_batch_invariant_here():
    """The negative control for the kernels' property: torch's float32 linear sums a row
    differently beside other rows (so the torch backend calls it one row at a time)."""
    torch.manual_seed(0)
    w, x = torch.randn(1536, 576), torch.randn(64, 576)
    alone = torch.cat([torch.nn.functional.linear(x[i : i + 1], w) for i in range(64)])
    assert not torch.equal(torch.nn.functional.linear(x, w), alone)


_HEAP_PROBE = """
import ctypes, sys, torch
from pdserve.engine import allocator
fields = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")
MallInfo2 = type("MallInfo2", (ctypes.Structure,), {"_fields_": [(f, ctypes.c_size_t) for f in fields]})
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "keep":
    assert allocator.keep_freed_memory()
free_before = libc.mallinfo2().fordblks  # free bytes the heap holds
x = torch.ones(6 << 20)  # 24 MB of float32
mmapped = libc.mallinfo2().hblkhd  # bytes in mmap'd blocks
del x
print(mmapped >= 24 << 20, libc.mallinfo2().fordblks - free_before >= 24 << 20)  # [mmap'd, held by the heap once freed]
"""


def test_the_engine_keeps_freed_memory_for_the_next_step():
    """allocator.py: on the CPU an engine keeps the C heap's freed memory, so a step's
    multi-MB tensors reuse pages the last step freed instead of faulting in fresh zeroed ones
    (210,000 faults per 2,048-token prefill of the bundled model with glibc's defaults; 0 after).
    A fresh process shows the mechanism: glibc mmaps a 24 MB tensor and unmaps it on free;
    tuned, it comes from the heap, which keeps it."""
    import subprocess
    import sys

    Engine(tiny_model("llama"), EngineConfig(num_blocks=16, block_size=4), EOS, 64)  # optimize=True
    assert allocator._applied is True

    def probe(mode: str) -> str:
        return subprocess.run([sys.executable, "-c", _HEAP_PROBE, mode], capture_output=True, text=True, check=True, timeout=120).stdout.split()

    assert probe("default") == ["True", "False"]
    assert probe("keep") == ["False", "True"]


def test_large_pool_tensors_sit_on_huge_pages_and_hold_zeros():
    """huge_pages.py: the KV pool and the packed weights (``gather``) are fresh mappings, 2 MiB aligned
    and advised for huge pages (backed by them where THP is on); small ones keep torch's
    allocator. Where THP is 'madvise' or 'always', the pages really are huge."""
    from pathlib import Path

    from pdserve.engine import huge_pages

    big = huge_pages.zeros((3, 1 << 20, 4), torch.bfloat16)  # 24 MiB
    assert big.shape == (3, 1 << 20, 4) and big.dtype == torch.bfloat16 and big.is_contiguous()
    assert big.data_ptr() % huge_pages.HUGE_PAGE == 0 and not big.any()
    big[1, 5, 2] = 7  # writable, and the write lands where a view says
    assert big[1].view(-1)[22].item() == 7 and int(big.ne(0).sum()) == 1
    small = huge_pages.zeros((16, 4), torch.float32)
    assert small.shape == (16, 4) and not small.any()
    assert huge_pages.zeros(5 << 20, torch.int32).shape == (5 << 20,)  # an int is a 1-d shape, as torch.zeros takes it
    with pytest.raises(ValueError, match="negative"):
        huge_pages.zeros((-2, -(1 << 24)), torch.uint8)  # refused before anything is mapped
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if thp.exists() and "[never]" not in thp.read_text():
        before = _anon_huge_kib()
        more = huge_pages.zeros((16 << 20,), torch.uint8)
        more.fill_(1)
        assert _anon_huge_kib() - before >= 8 << 10  # most of its 16 MiB on 2 MiB pages
    pool = PagedKVCache(KVSpec(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16), 4096, 16)
    assert pool.k.data_ptr() % huge_pages.HUGE_PAGE == 0 and not pool.v.any()
    # packed weights: one run of huge pages in the order given, each at a 64-byte boundary, same values
    weights = [torch.randn(1000, 1003).to(torch.bfloat16), torch.randint(0, 255, (8 << 20,), dtype=torch.uint8), torch.randn(7, 577)]
    placed = huge_pages.gather(weights)
    assert [(p.dtype, p.shape) for p in placed] == [(w.dtype, w.shape) for w in weights]
    assert all(torch.equal(p, w) for p, w in zip(placed, weights))
    assert placed[0].data_ptr() % huge_pages.HUGE_PAGE == 0
    ends = [p.data_ptr() + p.numel() * p.element_size() for p in placed]
    assert [p.data_ptr() for p in placed[1:]] == [-(-e // 64) * 64 for e in ends[:-1]]
    tiny = [torch.ones(3, 4)]
    assert huge_pages.gather(tiny)[0] is tiny[0]  # below MIN_BYTES: as they are


def test_logit_bias_equals_generates_sequence_bias_and_min_p_rows_do_not_depend_on_the_batch():
    """Greedy with logit_bias equals HF generate with the same biases (``sequence_bias``);
    seeded rows with min_p and logit_bias give the same ids batched with others and alone."""
    from transformers import GenerationConfig

    model, reference = tiny_model("llama"), tiny_model("llama")
    engine = Engine(model, EngineConfig(num_blocks=128, block_size=4, max_num_batched_tokens=32, chunk_size=8), EOS, 512)
    prompts = random_prompts([5, 17, 11, 26])
    plain = reference_generate(reference, prompts[0], 12, ignore_eos=True)
    bias = {plain[3]: -100.0, plain[5] + 1: 7.5, 2: 3.0}
    kinds = [dict(logit_bias=bias), dict(temperature=1.5, min_p=0.1, seed=3), dict(temperature=1.5, seed=3),
             dict(temperature=1.2, min_p=0.05, seed=4, logit_bias={7: 2.0})]
    seqs = [Sequence(f"r{i}", list(p), len(p), SamplingParams(max_tokens=12, ignore_eos=True, **kw)) for i, (p, kw) in enumerate(zip(prompts, kinds))]
    for seq in seqs:
        engine.add(seq)
    run_to_completion(engine)
    input_ids = torch.tensor([prompts[0]])
    config = GenerationConfig(do_sample=False, max_new_tokens=12, eos_token_id=[], pad_token_id=0, sequence_bias={(t,): b for t, b in bias.items()})
    want = reference.generate(input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config)[0, len(prompts[0]):].tolist()
    assert seqs[0].token_ids[len(prompts[0]):] == want != plain
    for i in (1, 3):
        alone = Sequence("alone", list(prompts[i]), len(prompts[i]), SamplingParams(max_tokens=12, ignore_eos=True, **kinds[i]))
        engine.add(alone)
        run_to_completion(engine)
        assert alone.token_ids == seqs[i].token_ids, kinds[i]
    assert_all_blocks_free(engine)


def _anon_huge_kib() -> int:
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


PENALTIES = [dict(repetition_penalty=2.0), dict(frequency_penalty=0.75), dict(presence_penalty=-1.5),
             dict(repetition_penalty=0.5, frequency_penalty=-0.5, presence_penalty=1.0), {}]


def test_penalties_batched_and_chunked_equal_generate_and_do_not_depend_on_the_batch():
    """Each request's penalties read its own prompt and output only: batched with others
    (penalised or not), chunked, and alone, its ids equal HF generate with the same penalties."""
    model, reference = tiny_model("llama"), tiny_model("llama")
    engine = Engine(model, EngineConfig(num_blocks=128, block_size=4, max_num_batched_tokens=32, chunk_size=8), EOS, 512)
    prompts = random_prompts([3, 20, 9, 33, 1])
    seqs = [Sequence(f"r{i}", list(p), len(p), SamplingParams(max_tokens=16, ignore_eos=True, **kw))
            for i, (p, kw) in enumerate(zip(prompts, PENALTIES))]
    for seq in seqs:
        engine.add(seq)
    run_to_completion(engine)
    for seq, prompt, kw in zip(seqs, prompts, PENALTIES):
        got = seq.token_ids[len(prompt):]
        assert got == reference_generate(reference, prompt, 16, ignore_eos=True, **kw), kw
        assert (got != reference_generate(reference, prompt, 16, ignore_eos=True)) == bool(kw), kw  # each penalty mattered
    alone = Sequence("alone", list(prompts[1]), len(prompts[1]), SamplingParams(max_tokens=16, ignore_eos=True, **PENALTIES[1]))
    engine.add(alone)
    run_to_completion(engine)
    assert alone.token_ids == seqs[1].token_ids
    assert_all_blocks_free(engine)
