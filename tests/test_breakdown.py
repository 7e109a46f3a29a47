"""bench/breakdown.py: the per-forward split of engine steps (linear / attention / other)."""

from transformers import AttentionInterface

from bench.breakdown import linear_bytes, linear_flops, timed_components
from conftest import tiny_model
from pdserve.engine import attention
from pdserve.engine.engine import Engine, EngineConfig
from test_engine import EOS, assert_all_blocks_free, generate_all, random_prompts


def test_timed_components_splits_every_forward_and_leaves_the_model_as_it_was():
    model = tiny_model("llama")
    engine = Engine(model, EngineConfig(num_blocks=64, block_size=4), EOS, 512)
    with timed_components(model) as parts:
        generate_all(engine, random_prompts([20, 7]), 5)
    assert parts["num_forwards"] == engine.num_steps == 5  # one packed prefill, then 4 decode steps
    assert parts["linear_s"] > 0 and parts["attention_s"] > 0 and parts["other_s"] > 0
    assert abs(parts["linear_s"] + parts["attention_s"] + parts["other_s"] - parts["forward_s"]) < 1e-9
    # hooks and the timing wrapper are gone
    assert AttentionInterface._global_mapping[attention.ATTN_IMPLEMENTATION] is attention.paged_attention
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert_all_blocks_free(engine)


def test_linear_sizes_count_the_lm_head_and_every_projection():
    model = tiny_model("qwen2")  # hidden 64, intermediate 128, 2 layers, 4 heads of 16, 2 KV heads, vocab 256
    per_layer = 64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128  # q, o; k, v; gate, up, down
    assert linear_flops(model, 10, lm_head_tokens=2) == 2 * 2 * per_layer * 10 + 2 * 256 * 64 * 2
    assert linear_bytes(model) == (2 * per_layer + 256 * 64) * 4  # float32


def test_narrow_twin_keeps_layers_heads_and_vocab_and_the_floors_add_up():
    """bench/floors.py: the twin shrinks only the widths, and the best ratios are the limits'
    arithmetic on the measured parts (fabricated here)."""
    from bench.floors import best_ratios, linear_limit_s, narrow_twin

    model = tiny_model("llama")
    twin = narrow_twin(model)
    cfg, tcfg = model.config, twin.config
    assert (tcfg.num_hidden_layers, tcfg.num_attention_heads, tcfg.num_key_value_heads, tcfg.vocab_size) == (
        cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size)
    assert twin.model.layers[0].self_attn.head_dim == model.model.layers[0].self_attn.head_dim
    assert tcfg.hidden_size == 16 * cfg.num_attention_heads and tcfg.intermediate_size == 128 and twin.dtype == model.dtype
    hw = {"mem_read_bytes_per_s": 1e9, "matmul_bf16_flops": 1e12, "matmul_fp32_flops": 1e11}  # float32 model: fp32 matmul
    assert linear_limit_s(model, 1, hw) == linear_bytes(model) / 1e9
    assert linear_limit_s(model, 32, hw) == max(linear_bytes(model) / 1e9, linear_flops(model, 32, lm_head_tokens=32) / 1e11)
    floors = {"b1": {"small_ops_s": 0.002}, "b32": {"small_ops_s": 0.004}}
    by_batch = {1: {"roofline_s": 0.010, "pdserve_s": 0.020}}
    got = best_ratios(model, floors, by_batch, kv_bytes_per_token=1000, context=100, hw=hw)
    best1 = linear_limit_s(model, 1, hw) + 100 * 1000 / 1e9 + 0.002
    best32 = linear_limit_s(model, 32, hw) + 32 * 100 * 1000 / 1e9 + 0.004
    assert got == {"decode_b1_best_over_roofline": best1 / 0.010, "decode_b32_best_over_b1": best32 / 0.020,
                   "decode_b32_best_over_best_b1": best32 / best1}
