"""Model families beyond Llama/Qwen2 (pdserve/engine/models): Qwen3's per-head q/k norms, and
Llama 3.x's llama3 and yarn rope scaling, each on a tiny random checkpoint from transformers'
own config class. float32 greedy ids equal HF ``model.generate`` in one engine (chunked,
batched) and across a prefill -> decode hand-off; a needle's ids and logprobs are the same
bits alone and in a batch; what the engine does not implement is refused by name, at
``pdserve up``'s pre-flight as at load."""

import random

import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV3Config, LlamaConfig, Phi3Config

from conftest import reference_generate, tiny_model
from pdserve.config import ClusterConfig, ConfigError
from pdserve.engine.engine import Engine, EngineConfig
from pdserve.engine.models import UnsupportedModelError, check_supported
from pdserve.engine.sequence import Sequence
from pdserve.sampling import SamplingParams
from pdserve.worker import check_pools
from test_engine import assert_all_blocks_free, random_prompts, run_to_completion

EOS = frozenset({2})
FAMILIES = ["qwen3", "mistral", "mistral_window", "phi3", "phi3_longrope", "mixtral", "qwen3_moe", "gemma2", "gemma3", "deepseek_v2", "deepseek_v2_lite", "llama3_rope",
            "yarn_rope"]
PROMPTS = random_prompts([1, 9, 31, 33, 70], seed=5)  # past the rope scalings' original context of 32


def engine_for(family: str, dtype=torch.float32, **config) -> Engine:
    return Engine(tiny_model(family, seed=3).to(dtype), EngineConfig(**{"num_blocks": 128, "block_size": 4, **config}), EOS, 512)


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_ids_equal_hf_generate_batched_and_chunked(family, backend):
    """On the cpu backend (and the portable torch one; the cuda backend's code on the CPU:
    test_cuda_backend_cpu.py)."""
    reference = tiny_model(family, seed=3)
    engine = engine_for(family, max_num_batched_tokens=40, chunk_size=16, backend=backend)
    seqs = [Sequence(f"r{i}", list(p), len(p), SamplingParams(max_tokens=12, ignore_eos=True)) for i, p in enumerate(PROMPTS)]
    for seq in seqs:
        engine.add(seq)
    run_to_completion(engine)
    for seq, p in zip(seqs, PROMPTS):
        assert seq.token_ids[len(p):] == reference_generate(reference, p, 12, ignore_eos=True)
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_to_decode_hand_off_equals_hf_generate(family):
    reference = tiny_model(family, seed=3)
    prefill, decode = engine_for(family), engine_for(family)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        assert hand_off(prefill, decode, p, params, str(i)) == reference_generate(reference, p, 10, ignore_eos=True)
    assert_all_blocks_free(prefill)
    assert_all_blocks_free(decode)


def hand_off(prefill: Engine, decode: Engine, prompt: list[int], params: SamplingParams, name: str) -> list[int]:
    """Prefill ``prompt`` to its first token, copy its KV blocks into ``decode``'s pool, free
    them in prefill and decode the rest. Returns the generated ids."""
    first = Sequence(f"p{name}", list(prompt), len(prompt), params, stop_after_first_token=True)
    prefill.add(first)
    run_to_completion(prefill)
    blocks = decode.reserve(len(prompt))
    src, dst = torch.tensor(first.block_table[: len(blocks)]), torch.tensor(blocks)
    for layer in range(decode.kv_spec.num_layers):
        decode.kv_cache.write_blocks(layer, dst, *prefill.kv_cache.read_blocks(layer, src))
    prefill.free_blocks(first.block_table)
    seq = Sequence(f"d{name}", list(first.token_ids), len(prompt), params, num_computed_tokens=len(prompt), block_table=blocks)
    decode.add(seq)
    run_to_completion(decode)
    return seq.token_ids[len(prompt):]


def needle_outputs(engine: Engine, prompts: list[list[int]], where: int) -> list:
    seqs = [Sequence(f"r{i}", list(p), len(p), SamplingParams(max_tokens=8, ignore_eos=True, logprobs=5)) for i, p in enumerate(prompts)]
    for seq in seqs:
        engine.add(seq)
    run_to_completion(engine)
    return [(lp.token_id, lp.logprob, list(lp.top)) for lp in seqs[where].logprobs]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_needle_is_the_same_bits_alone_and_anywhere_in_a_batch(family, dtype):
    needle = random_prompts([37], seed=11)[0]
    alone = needle_outputs(engine_for(family, dtype), [needle], 0)
    rng = random.Random(family)
    for batch in (3, 16):
        others = random_prompts([rng.randint(1, 60) for _ in range(batch - 1)], seed=batch)
        where = rng.randrange(batch)
        assert needle_outputs(engine_for(family, dtype), [*others[:where], needle, *others[where:]], where) == alone


@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_logprobs_close_to_hf_bfloat16(family, tmp_path):
    """vLLM's ``check_logprobs_close`` (top-5) against HF bf16 ``generate``, each family: the
    checkpoint saved and loaded back in bf16 by both sides (as a replica and HF load it)."""
    from pdserve.model_loader import load_checkpoint, load_model
    from test_engine_real import assert_logprobs_close_to_reference

    tiny_model(family, seed=3).save_pretrained(tmp_path)
    engine = Engine(load_checkpoint(tmp_path, "bfloat16"), EngineConfig(num_blocks=128, block_size=4, chunk_size=16), EOS, 512)
    assert_logprobs_close_to_reference(engine, load_model(tmp_path, "bfloat16"), PROMPTS, 12)


@pytest.mark.parametrize("config, message", [
    (LlamaConfig(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "rope type 'dynamic'"),
    (Phi3Config(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}), "partial rotary"),
    (DeepseekV3Config(architectures=["DeepseekV3ForCausalLM"]), "'DeepseekV3ForCausalLM' is not implemented.*supported: DeepseekV2ForCausalLM, Gemma2ForCausalLM, "
     "Gemma3ForCausalLM, LlamaForCausalLM, MistralForCausalLM, MixtralForCausalLM, Phi3ForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, "
     "Qwen3MoeForCausalLM"),
    (LlamaConfig(hidden_act="gelu"), "activation 'gelu'"),
    (DeepseekV2Config(architectures=["DeepseekV2ForCausalLM"], topk_method="noaux_tc"), "topk_method 'noaux_tc'"),
    (DeepseekV2Config(architectures=["DeepseekV2ForCausalLM"], topk_method="group_limited_greedy"), "n_group=None, topk_group=None"),
    (DeepseekV2Config(architectures=["DeepseekV2ForCausalLM"], topk_method="group_limited_greedy", n_group=3, topk_group=1),
     "n_group dividing the 64 experts"),
])
def test_what_the_engine_does_not_implement_is_refused_by_name_before_any_replica_starts(config, message):
    with pytest.raises(UnsupportedModelError, match=message):
        check_supported(config)
    with pytest.raises(ConfigError, match=message):  # pdserve up's pre-flight (pdserve_app/cli.py)
        check_pools(ClusterConfig.from_dict({}), config, "float32")


@pytest.mark.parametrize("family", [*FAMILIES, "llama", "qwen2"])
def test_the_implemented_families_pass_the_pre_flight(family):
    check_pools(ClusterConfig.from_dict({}), tiny_model(family).config, "float32")


@pytest.mark.parametrize("family", ["mistral_window", "gemma2", "gemma3"])
def test_windowed_and_soft_capped_logprobs_equal_hf_within_float32_rounding(family):
    """Greedy ids hide a final soft-cap (monotonic) and often an attention one: the top-5
    logprobs at every generated position against HF's eager forward over the same ids."""
    reference = tiny_model(family, seed=3)
    engine = engine_for(family, max_num_batched_tokens=40, chunk_size=16)
    seqs = [Sequence(f"r{i}", list(p), len(p), SamplingParams(max_tokens=6, ignore_eos=True, logprobs=5)) for i, p in enumerate(PROMPTS)]
    for seq in seqs:
        engine.add(seq)
    run_to_completion(engine)
    for seq, p in zip(seqs, PROMPTS):
        with torch.no_grad():
            logits = reference(torch.tensor([seq.token_ids[:-1]])).logits[0, len(p) - 1 :].float()  # [6, vocab]
        want = torch.log_softmax(logits, dim=-1).topk(5)
        for lp, values, ids in zip(seq.logprobs, want.values, want.indices):
            assert [t.token_id for t in lp.top] == ids.tolist()
            assert torch.allclose(torch.tensor([t.logprob for t in lp.top]), values, atol=1e-5, rtol=0)


def test_the_design_docs_model_table_lists_exactly_the_registry():
    import pathlib
    import re

    from pdserve.engine.models import MODELS

    text = (pathlib.Path(__file__).parents[2] / "docs" / "design.md").read_text()
    section = text[text.index("## Model support"):]
    table = next(part for part in section.split("\n\n") if part.startswith("| architecture |"))
    assert sorted(re.findall(r"^\| `(\w+ForCausalLM)` \| `(\w+)\.py`", table, re.M)) == sorted(
        (arch, cls.__module__.rsplit(".", 1)[-1]) for arch, cls in MODELS.items())


def test_deepseek_v2s_kv_pool_holds_its_latent_as_hf_caches_it():
    """MLA's KV is the latent (kv_layout.py): per token and layer kv_lora_rank + rope dims (32 +
    8 here) as one KV head of half that in k and half in v, so a hand-off moves 4x fewer bytes
    than this model's dense K and V would be (4 heads x (24 + 16) x 2 layers). The pool's
    latent after a prefill is HF's own cache (the normalized latent, the roped key) within
    float32 rounding."""
    from pdserve.kv_layout import KVSpec

    reference = tiny_model("deepseek_v2", seed=3)
    spec = KVSpec.from_model_config(reference.config, torch.float32)
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (2, 1, 20)
    assert spec.bytes_per_token == 2 * (32 + 8) * 4
    engine = engine_for("deepseek_v2")
    prompt = PROMPTS[3]
    seq = Sequence("r", list(prompt), len(prompt), SamplingParams(max_tokens=4), stop_after_first_token=True)  # its blocks kept, as for a hand-off
    engine.add(seq)
    run_to_completion(engine)
    with torch.no_grad():
        cache = reference(torch.tensor([prompt]), use_cache=True).past_key_values  # a DynamicCache
    bs = engine.kv_cache.block_size
    positions = torch.arange(len(prompt))
    slots = torch.tensor(seq.block_table)[positions // bs] * bs + positions % bs
    for layer in range(2):
        latent = torch.cat([engine.kv_cache.k[layer][0, slots], engine.kv_cache.v[layer][0, slots]], dim=1)  # [tokens, 40]
        keys, values = cache.layers[layer].keys[0, 0], cache.layers[layer].values[0, 0]  # [tokens, 32], [tokens, 8]
        torch.testing.assert_close(latent, torch.cat([keys, values], dim=1), rtol=1e-5, atol=1e-5)
    engine.free_blocks(seq.block_table)
    assert_all_blocks_free(engine)


def test_longrope_switches_tables_per_token_as_hf_generate_does(monkeypatch):
    """HF's longrope takes the long table for a forward whose last position + 1 passes the
    original context (32 here), and Phi-3's generate recomputes the whole sequence the step
    it grows past it: a long prompt's every token, and a short prompt's every token once it
    has grown past 32 (the prompt of 31 tokens crosses it while decoding). The negative
    control: every token on the long table gives other ids than HF's."""
    from pdserve.engine.layers.rotary import LongRopeRotary

    reference = tiny_model("phi3_longrope", seed=3)
    want = [reference_generate(reference, p, 12, ignore_eos=True) for p in PROMPTS]

    def generate():
        engine = engine_for("phi3_longrope", max_num_batched_tokens=40, chunk_size=16)
        assert isinstance(engine.model.layers[0].rotary, LongRopeRotary) and engine.model.fused is None
        seqs = [Sequence(f"r{i}", list(p), len(p), SamplingParams(max_tokens=12, ignore_eos=True)) for i, p in enumerate(PROMPTS)]
        for seq in seqs:
            engine.add(seq)
        run_to_completion(engine)
        return [seq.token_ids[len(p):] for seq, p in zip(seqs, PROMPTS)]

    assert generate() == want
    monkeypatch.setattr(LongRopeRotary, "rows", lambda self, meta: meta.positions + self.original)
    assert generate() != want


@pytest.mark.parametrize("family", ["phi3_longrope", "mistral_window", "gemma2", "deepseek_v2"])
def test_preempted_sequences_recompute_and_still_equal_hf_generate(family):
    """A pool of 20 blocks x 4 tokens for six sequences of up to 70: sequences are preempted
    and recomputed from their ids, generated tokens included (longrope's prompts of 20-30
    tokens cross its 32 while decoding, so recomputed tokens sit on both tables). Mistral's
    window keeps every block here (given back, they leave room enough: the test below)."""
    from test_engine import generate_all

    reference = tiny_model(family, seed=3)
    engine = engine_for(family, num_blocks=20, max_num_batched_tokens=64, chunk_size=64)
    engine.model.kv_window = None
    prompts = random_prompts([30, 25, 40, 33, 20, 28], seed=1)
    seqs = generate_all(engine, prompts, 30)
    assert engine.scheduler.num_preemptions > 0
    for seq, prompt in zip(seqs, prompts):
        assert seq.token_ids[len(prompt):] == reference_generate(reference, prompt, 30, ignore_eos=True)
    assert_all_blocks_free(engine)


def test_longrope_hand_off_of_a_prompt_of_the_original_length_recomputes_on_the_long_table():
    """A prompt of exactly 32 tokens (longrope's original context) is prefilled on the short
    table; with its first token the sequence is 33 long, so the decode engine does not keep
    the handed-over KV but recomputes the sequence on the long table, as HF's generate
    recomputes its cache. Ids equal HF's; both pools are back at baseline."""
    reference = tiny_model("phi3_longrope", seed=3)
    prompt = random_prompts([32], seed=9)[0]
    prefill, decode = engine_for("phi3_longrope"), engine_for("phi3_longrope")
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    first = Sequence("p", list(prompt), len(prompt), params, stop_after_first_token=True)
    prefill.add(first)
    run_to_completion(prefill)
    blocks = decode.reserve(len(prompt))
    for layer in range(decode.kv_spec.num_layers):
        decode.kv_cache.write_blocks(layer, torch.tensor(blocks), *prefill.kv_cache.read_blocks(layer, torch.tensor(first.block_table[: len(blocks)])))
    prefill.free_blocks(first.block_table)
    seq = Sequence("d", list(first.token_ids), len(prompt), params, num_computed_tokens=len(prompt), block_table=blocks)
    decode.add(seq)
    assert seq.num_computed_tokens == 0 and seq.kv_salt is not None  # the short-table KV given back, to recompute
    run_to_completion(decode)
    assert seq.token_ids[len(prompt):] == reference_generate(reference, prompt, 10, ignore_eos=True)
    assert_all_blocks_free(prefill)
    assert_all_blocks_free(decode)


def test_a_sliding_window_gives_back_the_blocks_it_no_longer_reaches():
    """Mistral with a window of 8 tokens on every layer: three sequences of 70-75 tokens in a
    pool of 24 blocks x 4 tokens. A sequence keeps the blocks of its window (and the one
    before the block it fills), so all three run to the end without a preemption and equal
    HF's generate; the negative control, the engine keeping every block, has to preempt.
    Afterwards every block is free (the given-back ones are not freed twice)."""
    reference = tiny_model("mistral_window", seed=3)
    prompts = random_prompts([40, 33, 45], seed=2)

    def run(keep_all: bool):
        engine = engine_for("mistral_window", num_blocks=24, max_num_batched_tokens=40, chunk_size=16)
        assert engine.model.kv_window == 8
        if keep_all:
            engine.model.kv_window = None
        seqs = [Sequence(f"r{i}", list(p), len(p), SamplingParams(max_tokens=30, ignore_eos=True)) for i, p in enumerate(prompts)]
        for seq in seqs:
            engine.add(seq)
        fewest_free = engine.block_manager.usage()["num_free_blocks"]
        while engine.scheduler.has_work():
            engine.step()
            fewest_free = min(fewest_free, engine.block_manager.usage()["num_free_blocks"])
        assert_all_blocks_free(engine)
        return engine.scheduler.num_preemptions, fewest_free, [seq.token_ids[len(p):] for seq, p in zip(seqs, prompts)]

    want = [reference_generate(reference, p, 30, ignore_eos=True) for p in prompts]
    preemptions, fewest_free, got = run(keep_all=False)
    assert got == want and preemptions == 0 and fewest_free > 0
    preemptions, _, got = run(keep_all=True)
    assert got == want and preemptions > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_32_concurrent_prompts_of_boundary_lengths_equal_hf_generate(family):
    """32 prompts at once, of the lengths where something changes: a block (4 tokens), a
    chunk (16), the key tiles of the attention kernels (16 and 32), the tiny windows (8) and
    longrope's switch (32), one below and one above each; 8 tokens each, the step budget
    cutting prompts into chunks."""
    reference = tiny_model(family, seed=3)
    lengths = [1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 24, 25, 31, 32, 33, 34, 40, 47, 48, 49, 63, 64, 65, 6, 12, 20, 28, 36, 44, 56, 70]
    prompts = random_prompts(lengths, seed=7)
    engine = engine_for(family, max_num_batched_tokens=64, chunk_size=16)
    seqs = [Sequence(f"r{i}", list(p), len(p), SamplingParams(max_tokens=8, ignore_eos=True)) for i, p in enumerate(prompts)]
    for seq in seqs:
        engine.add(seq)
    run_to_completion(engine)
    for seq, p in zip(seqs, prompts):
        assert seq.token_ids[len(p):] == reference_generate(reference, p, 8, ignore_eos=True), len(p)
    assert_all_blocks_free(engine)
