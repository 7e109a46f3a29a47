"""The static-shape decode step that CUDA graphs replay (pdserve/engine/cuda_graphs.py).

On the CPU the padded steps run eagerly (``cuda_graphs=True`` there), so these tests check
what a graph would compute: batches padded to a bucket, block tables padded with the
scratch block, padding rows confined to it. Capture and replay themselves run on a GPU
(tests/gpu/test_gpu.py).
"""

import torch

from conftest import reference_generate, tiny_model
from pdserve.engine.cuda_graphs import batch_buckets
from pdserve.engine.engine import Engine, EngineConfig
from test_engine import EOS, assert_all_blocks_free, generate_all, random_prompts


def test_buckets_cover_every_batch():
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert batch_buckets(5) == [1, 2, 4, 8]


def test_padded_static_decode_steps_equal_generate_and_touch_only_the_scratch_block():
    model, reference = tiny_model("qwen2"), tiny_model("qwen2")
    config = EngineConfig(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, chunk_size=32, cuda_graphs=True)
    engine = Engine(model, config, EOS, 128)
    graphs = engine.runner.graphs
    assert engine.block_manager.num_blocks == 63 and graphs.scratch_block == 63  # the last block is scratch, never handed out
    assert graphs.max_blocks == 32  # 128 tokens: 32 blocks of 4, every table's width
    assert sorted(graphs.steps) == [1, 2, 4, 8]  # every bucket made at start
    made = dict(graphs.steps)
    prompts = random_prompts([1, 5, 6, 13, 40, 3, 70], seed=3)  # 7 sequences: padded to 8
    engine.kv_cache.k.normal_()  # garbage where no sequence wrote: masked out, never read
    pool_before = engine.kv_cache.k.clone()
    seqs = generate_all(engine, prompts, 10)
    for seq, prompt in zip(seqs, prompts):
        assert seq.token_ids[len(prompt):] == reference_generate(reference, prompt, 10, ignore_eos=True)
    assert graphs.steps == made  # nothing made while serving
    # every block no sequence held is as it was, but the scratch block (padding rows write there)
    used = {b for seq in seqs for b in seq.block_table} | set(range(sum(-(-(len(p) + 10) // 4) for p in prompts)))
    unused = [b for b in range(63) if b not in used]
    k = engine.kv_cache.k.view(*engine.kv_cache.k.shape[:2], 64, 4, -1)  # [layers, kv_heads, blocks, block_size, head_dim]
    before = pool_before.view_as(k)
    assert unused and torch.equal(k[:, :, unused], before[:, :, unused])
    assert not torch.equal(k[:, :, 63, 0], before[:, :, 63, 0])  # padding rows wrote their K to the scratch slot
    assert_all_blocks_free(engine)


def test_preempted_and_batch_one_sequences_through_static_steps_equal_generate():
    model, reference = tiny_model("llama"), tiny_model("llama")
    config = EngineConfig(num_blocks=21, block_size=4, max_num_batched_tokens=64, chunk_size=64, cuda_graphs=True)
    engine = Engine(model, config, EOS, 512)  # 20 usable blocks: 80 slots for six sequences of up to 70 tokens
    prompts = random_prompts([30, 25, 40, 33, 20, 28], seed=1)
    seqs = generate_all(engine, prompts, 30)
    assert engine.scheduler.num_preemptions > 0
    for seq, prompt in zip(seqs, prompts):
        assert seq.token_ids[len(prompt):] == reference_generate(reference, prompt, 30, ignore_eos=True)
    assert_all_blocks_free(engine)


def test_a_failed_capture_falls_back_to_eager_steps(monkeypatch, caplog):
    from pdserve.engine import cuda_graphs

    def fail(self, num_seqs):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(cuda_graphs.DecodeGraphs, "_new_step", fail)
    model, reference = tiny_model("llama"), tiny_model("llama")
    engine = Engine(model, EngineConfig(num_blocks=32, block_size=4, cuda_graphs=True), EOS, 128)
    prompts = random_prompts([6, 11], seed=5)
    seqs = generate_all(engine, prompts, 8)
    for seq, prompt in zip(seqs, prompts):
        assert seq.token_ids[len(prompt):] == reference_generate(reference, prompt, 8, ignore_eos=True)
    assert "not permitted" in engine.runner.graphs.failed and "decode steps run eagerly" in caplog.text
    assert not engine.runner.graphs.steps
    assert_all_blocks_free(engine)
