"""The engine on the real model (SmolLM2-135M-Instruct) in-process, against model.generate.

float32: exact. bfloat16 (with the default fast paths): identical up to the first
difference, and there the reference's top two log-probabilities are within 0.05 (a near-tie);
on an AVX512-BF16 CPU, batched decode is exact as well.

The reference's log-probabilities are taken from its bf16 final hidden state through the
LM head in float32: its bf16 logits are rounded to steps of 0.125 at magnitudes 16-32, so
a gap measured on them is 0 or 0.125 and cannot resolve a 0.05 threshold.
"""

import pytest
import torch

from conftest import reference_generate
from pdserve.engine import paged_prefill
from pdserve.engine.engine import Engine, EngineConfig
from pdserve.engine.sequence import Sequence
from pdserve.model_loader import load_model, load_tokenizer
from pdserve.sampling import SamplingParams
from pdserve.worker import eos_token_ids
from test_engine import assert_all_blocks_free, generate_all, run_to_completion

TEXT = (
    "Rivers shape the land they cross. Over thousands of years a river cuts valleys, carries silt "
    "to the sea and builds deltas where it slows down. People have always settled along rivers "
    "for water, food, transport and fertile soil, and many of the first cities grew on their banks. "
)


@pytest.fixture(scope="module")
def real(real_model_dir):
    torch.set_num_threads(1)
    tokenizer = load_tokenizer(real_model_dir)
    ids = tokenizer(TEXT * 80).input_ids
    assert len(ids) > 3000
    return real_model_dir, tokenizer, ids


def engine_for(model_dir, dtype, **config):
    model = load_model(model_dir, dtype)
    return Engine(model, EngineConfig(**config), eos_token_ids(model, load_tokenizer(model_dir)), 8192)


def test_3000_token_prompt_prefilled_in_chunks_of_256_is_exact(real):
    model_dir, _, ids = real
    prompt = ids[:3000]
    engine = engine_for(model_dir, "float32", num_blocks=256, chunk_size=256, max_num_batched_tokens=256)
    seq = generate_all(engine, [prompt], 8)[0]
    assert engine.num_steps == 3000 // 256 + 1 + 7  # 12 prefill chunks, then 7 decode steps
    assert seq.token_ids[3000:] == reference_generate(load_model(model_dir, "float32"), prompt, 8, ignore_eos=True)
    assert_all_blocks_free(engine)


def test_preemption_on_a_small_pool_is_exact(real):
    model_dir, _, ids = real
    prompts = [ids[i * 50 : i * 50 + n] for i, n in enumerate([90, 60, 120, 75, 100, 40])]
    engine = engine_for(model_dir, "float32", num_blocks=40, block_size=16)  # 640 slots for ~600 prompt tokens + 6 x 24
    seqs = generate_all(engine, prompts, 24)
    assert engine.scheduler.num_preemptions > 0
    reference = load_model(model_dir, "float32")
    for seq, prompt in zip(seqs, prompts):
        assert seq.token_ids[len(prompt):] == reference_generate(reference, prompt, 24, ignore_eos=True)
    assert_all_blocks_free(engine)


def test_repeated_prompt_hits_the_prefix_cache_and_is_exact(real):
    model_dir, _, ids = real
    prompt = ids[:200]
    engine = engine_for(model_dir, "float32", num_blocks=64)
    first, second = generate_all(engine, [prompt], 8)[0], generate_all(engine, [prompt], 8)[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 192  # 12 full blocks of 16
    want = reference_generate(load_model(model_dir, "float32"), prompt, 8, ignore_eos=True)
    assert first.token_ids[200:] == want and second.token_ids[200:] == want
    assert_all_blocks_free(engine)


def test_bfloat16_batched_differs_only_at_near_ties(real):
    model_dir, _, ids = real
    prompts = [ids[i * 30 : i * 30 + n] for i, n in enumerate([1, 7, 16, 33, 64, 130, 250, 17])]
    engine = engine_for(model_dir, "bfloat16", num_blocks=128)  # defaults: packed bf16 weights
    seqs = generate_all(engine, prompts, 16)
    reference = load_model(model_dir, "bfloat16")
    for seq, prompt in zip(seqs, prompts):
        got, want = seq.token_ids[len(prompt):], reference_generate(reference, prompt, 16, ignore_eos=True)
        if got == want:
            continue
        first = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
        assert got[:first] == want[:first]
        with torch.inference_mode():
            hidden = reference.model(torch.tensor([prompt + want[:first]])).last_hidden_state[0, -1]
            logits = hidden.float() @ reference.lm_head.weight.float().T  # [vocab]
        top2 = torch.topk(torch.log_softmax(logits, -1), 2).values
        assert float(top2[0] - top2[1]) <= 0.05, f"not a near-tie at position {first}"
    assert_all_blocks_free(engine)


def test_bfloat16_batched_decode_equals_the_reference_token_for_token(real):
    """With the defaults on an AVX512-BF16 CPU (the prompt- and decode-attention kernels rounding as
    torch's flash attention, decode rows of the linear layers summed as oneDNN sums a lone row), 12
    prompts of 1-620 tokens decoded together give exactly the reference's greedy tokens."""
    from pdserve.engine import exact_gemv

    if not (exact_gemv.available() and paged_decode_supported(torch.bfloat16)):
        pytest.skip("needs AVX512-BF16 and a C compiler: elsewhere batched bf16 may differ at near-ties")
    model_dir, _, ids = real
    lengths = [1, 7, 16, 33, 64, 130, 250, 17, 500, 620, 90, 45]
    prompts = [ids[i * 37 : i * 37 + n] for i, n in enumerate(lengths)]
    engine = engine_for(model_dir, "bfloat16", num_blocks=256)
    assert engine.runner.decode_kernel
    assert engine.runner.prefill_kernel == paged_prefill.supports(torch.bfloat16, torch.device("cpu"), 64)  # prompts too, where it runs
    seqs = generate_all(engine, prompts, 24)
    reference = load_model(model_dir, "bfloat16")
    for seq, prompt in zip(seqs, prompts):
        assert seq.token_ids[len(prompt):] == reference_generate(reference, prompt, 24, ignore_eos=True), len(prompt)
    assert_all_blocks_free(engine)


def test_bfloat16_chunked_prefill_and_prefix_hit_equal_the_reference(real):
    """With the prompt kernel, bf16 is exact where torch SDPA was not: a 3,000-token prompt
    prefilled in chunks of 256 leaves the reference's KV in the pool bit for bit (each chunk's
    attention rounds as the reference's one causal call over the whole prompt; with masked SDPA
    per chunk ~2/3 of the KV differed), and it, then the same prompt again (the rest of a
    prefix-cache hit), give the reference's greedy tokens."""
    from pdserve.engine import exact_gemv

    if not (exact_gemv.available() and paged_prefill.supports(torch.bfloat16, torch.device("cpu"), 64)):
        pytest.skip("needs AVX512-BF16 and a C compiler: elsewhere chunks go through torch's masked SDPA")
    model_dir, _, ids = real
    prompt = ids[:3000]
    engine = engine_for(model_dir, "bfloat16", num_blocks=256, chunk_size=256, max_num_batched_tokens=256)
    reference = load_model(model_dir, "bfloat16")
    with torch.inference_mode():
        cache = reference(torch.tensor([prompt]), use_cache=True).past_key_values
    first = Sequence("first", list(prompt), 3000, SamplingParams(max_tokens=8, ignore_eos=True))
    engine.add(first)
    for _ in range(3000 // 256 + 1):  # the 12 prefill chunks
        engine.step()
    slots = engine.kv_cache.slots(first.block_table, 0, 3000)
    for layer in range(len(cache.layers)):  # [kv_heads, 3000, head_dim] each
        assert torch.equal(engine.kv_cache.k[layer][:, slots], cache.layers[layer].keys[0]), layer
        assert torch.equal(engine.kv_cache.v[layer][:, slots], cache.layers[layer].values[0]), layer
    run_to_completion(engine)
    second = generate_all(engine, [prompt], 8)[0]
    assert second.num_cached_tokens == 2992  # 187 full blocks of 16 from the first
    want = reference_generate(reference, prompt, 8, ignore_eos=True)
    assert first.token_ids[3000:] == want and second.token_ids[3000:] == want
    assert_all_blocks_free(engine)


def paged_decode_supported(dtype) -> bool:
    from pdserve.engine import paged_decode

    return paged_decode.supports(dtype, torch.device("cpu"))


def test_decode_kernel_float32_batched_is_exact(real):
    """The C paged-attention kernel (decode_kernel) in float32: mixed lengths crossing
    512-token splits, decoded together, equal the reference token for token."""
    from pdserve.engine import paged_decode

    if not paged_decode.supports(torch.float32, torch.device("cpu")):
        pytest.skip("no C compiler here")
    model_dir, _, ids = real
    prompts = [ids[i * 40 : i * 40 + n] for i, n in enumerate([1, 15, 16, 17, 100, 505, 700])]
    engine = engine_for(model_dir, "float32", num_blocks=128, decode_kernel=True)
    assert engine.runner.decode_kernel
    seqs = generate_all(engine, prompts, 16)
    reference = load_model(model_dir, "float32")
    for seq, prompt in zip(seqs, prompts):
        assert seq.token_ids[len(prompt):] == reference_generate(reference, prompt, 16, ignore_eos=True)
    assert_all_blocks_free(engine)
