"""bench/breakdown.py: the per-forward split of engine steps (linear / attention / other)."""

from bench.breakdown import linear_bytes, linear_flops, timed_components
from conftest import tiny_model
from pdserve.engine.engine import Engine, EngineConfig
from test_engine import EOS, assert_all_blocks_free, generate_all, random_prompts


def test_timed_components_splits_every_forward_and_leaves_the_engine_as_it_was():
    engine = Engine(tiny_model("llama"), EngineConfig(num_blocks=64, block_size=4), EOS, 512)
    with timed_components(engine) as parts:
        generate_all(engine, random_prompts([20, 7]), 5)
    assert parts["num_forwards"] == engine.num_steps == 5  # one packed prefill, then 4 decode steps
    assert parts["linear_s"] > 0 and parts["attention_s"] > 0 and parts["other_s"] > 0
    assert abs(parts["linear_s"] + parts["attention_s"] + parts["other_s"] - parts["forward_s"]) < 1e-9
    assert not {"linear", "forward"} & set(vars(engine.backend)) and "forward" not in vars(engine.model)  # timers gone
    assert_all_blocks_free(engine)


def test_linear_sizes_count_the_lm_head_and_every_projection():
    model = tiny_model("qwen2")  # hidden 64, intermediate 128, 2 layers, 4 heads of 16, 2 KV heads, vocab 256
    per_layer = 64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128  # q, o; k, v; gate, up, down
    assert linear_flops(model, 10, lm_head_tokens=2) == 2 * 2 * per_layer * 10 + 2 * 256 * 64 * 2
    assert linear_bytes(model) == (2 * per_layer + 256 * 64) * 4  # float32
