"""Batch invariance, bitwise: a request's token ids and logprobs do not depend on what else runs.

As vLLM's ``tests/v1/generation/test_batch_invariance.py``: a "needle" request is run alone,
then at a random place in batches of 32 and 64 of other requests, and its logprobs are
compared with ``==`` (bits, not a tolerance). The same needle is also prefilled in chunks,
preempted and recomputed, migrated (recomputed from its prompt and the tokens it already
streamed), and handed from a prefill engine on 2 threads to a decode engine on 1
(disaggregated), against one engine doing both (colocated). In float32 and in bf16, on the
engine's default backend (``cpu`` where the kernels build, else ``torch``).

The negative control runs the same comparison through a backend whose linear layers are
torch's batched float32 matmul, which sums a row differently beside other rows: the check
must see the difference, or it proves nothing.
"""

import random

import pytest
import torch
import torch.nn.functional as F

from conftest import require_kernels, tiny_model
from pdserve.engine import backends
from pdserve.engine.backends.torch_sdpa import TorchBackend
from pdserve.engine.cpu import ops
from pdserve.engine.engine import Engine, EngineConfig
from pdserve.engine.sequence import Sequence
from pdserve.sampling import SamplingParams
from test_engine import assert_all_blocks_free, random_prompts, run_to_completion

EOS = frozenset({2})
NUM_TOKENS = 12
DTYPES = [torch.float32, torch.bfloat16]


def params() -> SamplingParams:
    return SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=5)


def model(dtype, family="llama"):
    return tiny_model(family, seed=7).to(dtype)


def engine_for(dtype, backend="auto", num_blocks=512, family="llama", **config) -> Engine:
    return Engine(model(dtype, family), EngineConfig(num_blocks=num_blocks, block_size=4, backend=backend, **config), EOS, 512)


def outputs(seq: Sequence, start: int = 0) -> list:
    """The needle's generated ids and logprobs (token, logprob, top-5) from generated token ``start``."""
    return [(lp.token_id, lp.logprob, [(t.token_id, t.logprob) for t in lp.top]) for lp in seq.logprobs[start:]]


def run(engine: Engine, prompts: list[list[int]], needle: int) -> Sequence:
    seqs = [Sequence(f"r{i}", list(p), len(p), params()) for i, p in enumerate(prompts)]
    for seq in seqs:
        engine.add(seq)
    run_to_completion(engine)
    assert_all_blocks_free(engine)
    return seqs[needle]


NEEDLE = random_prompts([37], seed=11)[0]


def alone(dtype, backend="auto") -> list:
    return outputs(run(engine_for(dtype, backend), [NEEDLE], 0))


def in_batch(engine: Engine, batch_size: int, seed: int) -> list:
    rng = random.Random(seed)
    others = random_prompts([rng.randint(1, 60) for _ in range(batch_size - 1)], seed=seed)
    where = rng.randrange(batch_size)
    return outputs(run(engine, others[:where] + [NEEDLE] + others[where:], where))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch_size", [2, 32, 64])
def test_needle_alone_equals_needle_anywhere_in_a_batch(dtype, batch_size):
    want = alone(dtype)
    engine = engine_for(dtype, max_num_seqs=64, max_num_batched_tokens=4096)
    for seed in (1, 2):  # two random places, two sets of neighbours
        assert in_batch(engine, batch_size, seed) == want, (dtype, batch_size, seed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunk_size", [1, 5, 16])
def test_needle_prefilled_in_chunks_equals_whole(dtype, chunk_size):
    engine = engine_for(dtype, chunk_size=chunk_size, max_num_batched_tokens=max(chunk_size, 8))
    others = random_prompts([20, 9], seed=3)  # chunks share steps with other prompts and decodes
    assert outputs(run(engine, [others[0], NEEDLE, others[1]], 1)) == alone(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_needle_preempted_and_recomputed_equals_alone(dtype):
    engine = engine_for(dtype, num_blocks=40)  # 160 slots for ~230 tokens: preemption
    prompts = random_prompts([30, 25, 33, 20], seed=4)
    seqs = [Sequence(f"r{i}", list(p), len(p), params()) for i, p in enumerate([NEEDLE, *prompts])]
    for seq in seqs:
        engine.add(seq)
    run_to_completion(engine)
    assert engine.scheduler.num_preemptions > 0
    assert outputs(seqs[0]) == alone(dtype)
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("resume_after", [1, 5])
def test_needle_migrated_mid_stream_equals_alone(dtype, resume_after):
    """A decode replica died after ``resume_after`` tokens: another recomputes prompt + those
    tokens in one prefill and goes on (decode_worker/server.py); the rest is the same bits."""
    want = alone(dtype)
    done = [*NEEDLE, *(t for t, _, _ in want[:resume_after])]
    seq = Sequence("moved", done, len(NEEDLE), params())
    engine = engine_for(dtype)
    engine.add(seq)
    run_to_completion(engine)
    assert outputs(seq) == want[resume_after:]
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("dtype", DTYPES)
def test_disaggregated_equals_colocated(dtype):
    """Prefill on 2 threads, the prompt's KV blocks copied into a decode engine on 1 thread,
    against one engine doing both: the same bits (the kernels split work, never sums)."""
    colocated = alone(dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        prefill = engine_for(dtype)
    finally:
        torch.set_num_threads(1)
    decode = engine_for(dtype)
    torch.set_num_threads(threads)
    first = Sequence("p", list(NEEDLE), len(NEEDLE), params(), stop_after_first_token=True)
    prefill.add(first)
    run_to_completion(prefill)
    blocks = decode.reserve(len(NEEDLE))
    src = torch.tensor(first.block_table[: len(blocks)], dtype=torch.long)
    for layer in range(decode.kv_spec.num_layers):
        k, v = prefill.kv_cache.read_blocks(layer, src)
        decode.kv_cache.write_blocks(layer, torch.tensor(blocks, dtype=torch.long), k, v)
    prefill.free_blocks(first.block_table)
    seq = Sequence("d", [*NEEDLE, first.token_ids[-1]], len(NEEDLE), params(), num_computed_tokens=len(NEEDLE), block_table=blocks)
    seq.logprobs = list(first.logprobs)
    decode.add(seq)
    run_to_completion(decode)
    assert prefill.backend.num_threads == 2 and decode.backend.num_threads == 1
    assert outputs(seq) == colocated
    assert_all_blocks_free(prefill)
    assert_all_blocks_free(decode)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_fused_layers_equal_the_layer_by_layer_path(dtype, family):
    """The cpu backend runs a step's decoder layers in one C call (cpu/decoder.c): every
    sequence's ids and logprobs are the bits of calling the layers one by one (Qwen2 brings
    the QKV biases), prompts and decodes mixed."""
    prompts = random_prompts([37, 5, 60, 1], seed=9)
    results = []
    for fused in (True, False):
        engine = engine_for(dtype, family=family, max_num_batched_tokens=64, chunk_size=32)
        if engine.backend.name != "cpu":
            require_kernels(*ops.KERNELS, "decoder")  # skips without a compiler, else fails naming the kernel
        assert engine.model.fused is not None
        if not fused:
            engine.model.fused = None
        seqs = [Sequence(f"r{i}", list(p), len(p), params()) for i, p in enumerate(prompts)]
        for seq in seqs:
            engine.add(seq)
        run_to_completion(engine)
        assert_all_blocks_free(engine)
        results.append([outputs(seq) for seq in seqs])
    assert results[0] == results[1]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_torch_backend_is_batch_invariant_too(family):
    """The portable fallback keeps the rule (fixed-shape matmuls, one attention call per row)."""
    want = outputs(run(engine_for(torch.float32, "torch", family=family), [NEEDLE], 0))
    engine = engine_for(torch.float32, "torch", family=family, max_num_seqs=64)
    assert in_batch(engine, 8, 5) == want


class _BatchedMatmulBackend(TorchBackend):
    """The negative control: torch's batched float32 matmul, not batch invariant."""

    name = "batched-matmul"

    def linear(self, x, packed, out_features, bias):
        return F.linear(x, packed, bias)


def test_negative_control_a_batched_matmul_breaks_the_check(monkeypatch):
    monkeypatch.setitem(backends.BACKENDS, "batched-matmul", _BatchedMatmulBackend)
    monkeypatch.setattr(backends, "CHOICES", (*backends.CHOICES, "batched-matmul"))
    want = alone(torch.float32, "batched-matmul")
    engine = engine_for(torch.float32, "batched-matmul", max_num_seqs=64, max_num_batched_tokens=4096)
    assert in_batch(engine, 32, 1) != want  # the same comparison as above sees the broken invariance
