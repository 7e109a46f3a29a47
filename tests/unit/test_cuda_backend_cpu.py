"""The ``cuda`` backend's own code (pdserve/engine/backends/cuda.py) on the CPU device.

``backends.resolve`` refuses ``cuda`` off a GPU unless a test sets TEST_CUDA_ON_CPU_ENV, as
every test here does: the engine then runs CudaBackend on the CPU, FlexAttention eagerly over
the paged pool, and its greedy ids must equal model.generate's token for token (float32,
every family), and each sampled token's logprob the reference's within LOGPROB_ATOL. A spy
on the backend's ``attend`` records which mask kinds ran (decode rows, query blocks,
windows) and checks that every block mask lists each key its mask_mod lets through: a GPU
kernel reads listed blocks only, the eager CPU path reads them all, so this is what keeps
the two the same. A step's tensor ops are counted too: the same for 1 and 32 sequences.
Graph capture and GPU numerics run on a GPU only (tests/gpu/test_gpu.py).
"""

import os
import sys
from collections import Counter

import pytest
import torch
from torch.overrides import TorchFunctionMode

from conftest import reference_generate, tiny_model
from pdserve.engine import backends
from pdserve.engine.backends import cuda, flex_paged
from pdserve.engine.backends.cuda import CudaBackend
from pdserve.engine.engine import Engine, EngineConfig
from pdserve.engine.sequence import Sequence
from pdserve.sampling import SamplingParams
from test_engine import EOS, assert_all_blocks_free, random_prompts, run_to_completion

# float32 on the CPU: batched matmuls and attention round unlike HF's one-sequence forward by
# ~1e-6; a wrong mask or a misplaced K/V moves a logprob by orders of magnitude more
LOGPROB_ATOL = 1e-4


def dense_mask(mask: flex_paged.PagedMask, num_queries: int, slots: int) -> torch.Tensor:
    """[B, 1, Q, slots] bool: the mask_mod at every (row, query, key)."""
    B = mask.block_mask.kv_indices.shape[0]
    b, q, kv = torch.arange(B)[:, None, None], torch.arange(num_queries)[None, :, None], torch.arange(slots)[None, None, :]
    return mask.block_mask.mask_mod(b, 0, q, kv).expand(B, num_queries, slots)[:, None]


class AttentionSpy:
    """Wraps cuda.attend: counts calls by mask kind and checks each mask's block lists."""

    def __init__(self):
        self.calls = Counter()

    def __call__(self, q, k_pool, v_pool, mask, scale, softcap=None):
        self.calls["decode" if mask.decode else "blocks"] += 1
        if softcap is not None:
            self.calls["softcap"] += 1
        queries = 1 if mask.decode else q.shape[0]
        assert flex_paged.covers(mask, dense_mask(mask, queries, k_pool.shape[1]))
        return flex_paged.attend(q, k_pool, v_pool, mask, scale, softcap)


@pytest.fixture
def spy(monkeypatch):
    monkeypatch.setenv(backends.TEST_CUDA_ON_CPU_ENV, "1")
    spy = AttentionSpy()
    monkeypatch.setattr(cuda, "attend", spy)
    return spy


def generate_all(engine: Engine, prompts, max_tokens: int) -> list[Sequence]:
    """test_engine's, with each sampled token's logprob recorded."""
    seqs = [Sequence(f"r{i}", list(p), len(p), SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=0))
            for i, p in enumerate(prompts)]
    for seq in seqs:
        engine.add(seq)
    run_to_completion(engine)
    return seqs


def assert_equals_reference(reference, seq: Sequence, prompt: list[int], max_tokens: int) -> None:
    """Greedy ids as model.generate's, token for token; each logprob as the reference's in
    one forward over prompt and output."""
    output = seq.token_ids[len(prompt):]
    assert output == reference_generate(reference, prompt, max_tokens, ignore_eos=True)
    with torch.inference_mode():
        logits = reference(torch.tensor([prompt + output])).logits[0, len(prompt) - 1:-1].float()
    want = torch.log_softmax(logits, -1)[torch.arange(len(output)), torch.tensor(output)]
    got = torch.tensor([lp.logprob for lp in seq.logprobs])
    torch.testing.assert_close(got, want, atol=LOGPROB_ATOL, rtol=0)


def cuda_engine(model, max_len: int = 512, **config) -> Engine:
    engine = Engine(model, EngineConfig(backend="cuda", **config), EOS, max_len)
    assert type(engine.backend) is CudaBackend and engine.kv_cache.device.type == "cpu"
    return engine


def test_cuda_is_refused_off_a_gpu_without_the_test_switch(monkeypatch):
    monkeypatch.delenv(backends.TEST_CUDA_ON_CPU_ENV, raising=False)
    with pytest.raises(ValueError, match="backend 'cuda' needs the model on a GPU, not cpu"):
        backends.resolve("cuda", torch.float32, torch.device("cpu"))
    monkeypatch.setenv(backends.TEST_CUDA_ON_CPU_ENV, "1")
    assert backends.resolve("cuda", torch.float32, torch.device("cpu")) == "cuda"
    assert backends.resolve("auto", torch.float32, torch.device("cpu")) != "cuda"  # the switch never picks cuda itself


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "phi3", "mixtral", "qwen3_moe", "llama3_rope", "mistral_window", "gemma2", "gemma3",
                                    "deepseek_v2"])
def test_batched_chunked_prefill_and_decode_equal_generate(family, spy):
    model, reference = tiny_model(family), tiny_model(family)
    engine = cuda_engine(model, num_blocks=128, block_size=4, max_num_batched_tokens=64, chunk_size=16)
    prompts = random_prompts([1, 5, 16, 17, 40, 3, 64, 9])
    seqs = generate_all(engine, prompts, 12)
    for seq, prompt in zip(seqs, prompts):
        assert_equals_reference(reference, seq, prompt, 12)
        assert seq.finish_reason == "length"
    assert engine.num_steps < 8 * 12  # sequences shared forwards
    if family == "deepseek_v2":  # latent attention: the base class's torch rows
        assert not spy.calls
        return
    # whole prompts, later 16-token chunks of the 17-, 40- and 64-token prompts and decode rows
    # beside prompt chunks (query blocks), and decode-only steps (a row per sequence)
    assert spy.calls["decode"] > 0 and spy.calls["blocks"] > 0, spy.calls
    assert (spy.calls["softcap"] > 0) == (family == "gemma2")
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_prefix_cache_hit_attends_to_the_cached_blocks_and_equals_generate(family, spy):
    model, reference = tiny_model(family), tiny_model(family)
    engine = cuda_engine(model, num_blocks=64, block_size=4)
    prompt = random_prompts([41])[0]
    assert_equals_reference(reference, generate_all(engine, [prompt], 8)[0], prompt, 8)
    # a prompt sharing the first 9 tokens: 2 blocks cached, its other 21 tokens one chunk after them
    other = prompt[:9] + random_prompts([20], seed=5)[0]
    third = generate_all(engine, [other], 4)[0]
    assert third.num_cached_tokens == 8
    assert_equals_reference(reference, third, other, 4)
    assert_all_blocks_free(engine)


def test_preemption_recomputes_and_still_equals_generate(spy):
    model, reference = tiny_model("llama"), tiny_model("llama")
    # 20 blocks x 4 tokens = 80 slots for six sequences of up to 70 tokens each.
    engine = cuda_engine(model, num_blocks=20, block_size=4, max_num_batched_tokens=64, chunk_size=64)
    prompts = random_prompts([30, 25, 40, 33, 20, 28], seed=1)
    seqs = generate_all(engine, prompts, 30)
    assert engine.scheduler.num_preemptions > 0
    for seq, prompt in zip(seqs, prompts):
        assert_equals_reference(reference, seq, prompt, 30)
    assert spy.calls["decode"] > 0
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("family", ["qwen2", "mistral_window", "gemma2"])
def test_padded_static_decode_steps_equal_generate(family, spy):
    """``cuda_graphs=True`` on the CPU: the padded static-shape decode steps a graph would
    record, run eagerly, their block masks rebuilt from the static inputs every step (a
    sliding window's too, its leading blocks given back as it passes them)."""
    model, reference = tiny_model(family), tiny_model(family)
    engine = cuda_engine(model, 128, num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, chunk_size=32, cuda_graphs=True)
    graphs = engine.runner.graphs
    assert graphs is not None and not graphs.capture
    prompts = random_prompts([1, 5, 6, 13, 40, 3, 70], seed=3)  # 7 sequences: padded to 8
    engine.kv_cache.k.normal_()  # garbage where no sequence wrote: masked out, never read
    seqs = generate_all(engine, prompts, 10)
    for seq, prompt in zip(seqs, prompts):
        assert_equals_reference(reference, seq, prompt, 10)
    assert sorted(graphs.steps) == [1, 2, 4, 8] and graphs.failed is None
    assert spy.calls["decode"] > 0
    assert_all_blocks_free(engine)


def reference_mask(tables: list[list[int]], lens: list[int], token_seq: list[int], positions: list[int], bs: int, slots: int,
                   window: int | None) -> torch.Tensor:
    """[N, slots] bool, one query at a time in Python: the keys query t may see."""
    out = torch.zeros(len(token_seq), slots, dtype=torch.bool)
    for t, (s, p) in enumerate(zip(token_seq, positions)):
        for pos in range(p + 1):
            if window is None or pos > p - window:
                out[t, tables[s][pos // bs] * bs + pos % bs] = True
    return out


@pytest.mark.parametrize("window", [None, 6])
def test_the_block_mask_is_each_querys_own_keys_and_lists_them(window):
    """Three sequences in one step (a 9-token chunk after 8 cached tokens, a 3-token prompt, a
    decode row), the first two sharing a prefix block, all in one query block: the mask lets a
    query see exactly its sequence's keys up to its position (within the window), and the
    query block lists the shared block once. With a window, row 2's first block (outside its
    window, so freed) is in row 1's table too. A decode-only step: each row its own table."""
    bs, num_blocks = 4, 12
    tables = [[3, 7, 1, 9, 11], [3, 5, 0, 0, 0], [2, 4, 6, 8, 10]]  # row 1's table padded with block 0
    if window is not None:
        tables[1][1] = 2
    lens = [17, 7, 17]
    token_seq = [0] * 9 + [1] * 3 + [2]
    positions = list(range(8, 17)) + [4, 5, 6] + [16]
    slots = num_blocks * bs
    mask = flex_paged.PagedMask.build(torch.tensor(tables, dtype=torch.int32), torch.tensor(lens), torch.tensor(token_seq, dtype=torch.int32),
                                      torch.tensor(positions), num_blocks, bs, decode=False, window=window)
    dense = dense_mask(mask, len(token_seq), slots)
    assert torch.equal(dense[0, 0], reference_mask(tables, lens, token_seq, positions, bs, slots, window))
    assert flex_paged.covers(mask, dense)
    listed = mask.block_mask.kv_indices[0, 0, 0, : int(mask.block_mask.kv_num_blocks[0, 0, 0])].tolist()
    assert len(listed) == len(set(listed)) and 3 in listed  # the shared block, once
    decode = flex_paged.PagedMask.build(torch.tensor(tables, dtype=torch.int32), torch.tensor(lens), torch.arange(3, dtype=torch.int32),
                                        torch.tensor(lens) - 1, num_blocks, bs, decode=True, window=window)
    dense = dense_mask(decode, 1, slots)
    assert torch.equal(dense[:, 0, 0], reference_mask(tables, lens, [0, 1, 2], [n - 1 for n in lens], bs, slots, window))
    assert flex_paged.covers(decode, dense)


class CountOps(TorchFunctionMode):
    """Counts the torch calls pdserve's own code makes (functions and tensor methods), by name
    and line (torch's internals, e.g. its compile caches, are not ours to count)."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if torch.compiler.is_compiling():  # flex_attention's eager path traces itself: torch's, not ours
            return func(*args, **(kwargs or {}))
        caller = sys._getframe(1)
        if f"{os.sep}pdserve{os.sep}" in caller.f_code.co_filename:
            self.ops[(getattr(func, "__name__", str(func)), caller.f_code.co_filename.rsplit(os.sep, 1)[-1], caller.f_lineno)] += 1
        return func(*args, **(kwargs or {}))


def test_a_step_runs_the_same_tensor_ops_for_1_and_for_32_sequences(monkeypatch):
    """No per-sequence Python calls into torch: a prefill step and a decode step of 1 sequence
    and of 32 run the same ops, as many times (the step's metadata is built from Python lists,
    then one op per tensor)."""
    monkeypatch.setenv(backends.TEST_CUDA_ON_CPU_ENV, "1")
    model = tiny_model("llama")

    def count(num_seqs: int) -> tuple[Counter, Counter]:
        engine = cuda_engine(model, num_blocks=256, block_size=4, max_num_seqs=32, max_num_batched_tokens=1024, chunk_size=1024)
        for i, p in enumerate(random_prompts([5 + i % 7 for i in range(num_seqs)], seed=num_seqs)):
            engine.add(Sequence(f"r{i}", list(p), len(p), SamplingParams(max_tokens=4, ignore_eos=True)))
        with CountOps() as prefill:
            engine.step()
        with CountOps() as decode:
            engine.step()
        run_to_completion(engine)
        return prefill.ops, decode.ops

    one, many = count(1), count(32)
    for a, b in zip(one, many):
        assert a == b, (a - b, b - a)
