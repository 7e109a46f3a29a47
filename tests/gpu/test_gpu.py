"""GPU integration tests (markers ``gpu`` and ``multi_gpu``), skipped with the reason where
no CUDA device is visible. One command runs them on a GPU node: ``bash scripts/test_gpu.sh``.

- cuda_ipc between two processes: blocks move device to device, bit-exact, checksummed,
  the lease acknowledged; a corrupted copy is caught.
- The engine on a GPU, float32: batched greedy decode equals ``model.generate`` there, with
  decode steps replayed from CUDA graphs (the default) and without.
- The whole cluster on GPUs: prefill and decode each on its own GPU where there are two
  (``multi_gpu``), both on one GPU otherwise; KV over cuda_ipc; output equals the reference.

Written in a session without a GPU: not yet run on one.
"""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from conftest import NO_CUPY, NO_GPU, NO_TWO_GPUS
from kv_transfer import cuda_ipc_backend

NUM_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs_gpu = pytest.mark.skipif(NUM_GPUS < 1, reason=NO_GPU)
needs_cupy = pytest.mark.skipif(NUM_GPUS >= 1 and not cuda_ipc_backend.available(), reason=NO_CUPY)
BLOCK_SIZE, NUM_TOKENS = 16, 60
SRC_BLOCKS = [3, 7, 8, 20]  # 60 tokens: 3 full blocks and a partial one


def _sender(conn, device: str) -> None:
    """A prefill-like process: a GPU pool exported over CUDA IPC, one transfer leased."""
    from kv_transfer.paged import PagedKVSource
    from kv_transfer.cuda_ipc_backend import CudaIpcPoolMemory
    from kv_transfer.server import KVServer
    from pdserve.engine.kv_cache import PagedKVCache
    from pdserve.kv_layout import KVSpec

    spec = KVSpec(num_layers=3, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    cache = PagedKVCache(spec, 32, BLOCK_SIZE, device=device, memory=CudaIpcPoolMemory())
    cache.k.copy_(torch.randn(cache.k.shape, device=device).to(spec.dtype))
    cache.v.copy_(torch.randn(cache.v.shape, device=device).to(spec.dtype))
    server = KVServer("127.0.0.1", backend="cuda_ipc", block_size=BLOCK_SIZE, cuda_ipc=True, node_id="gpu-node")
    source = PagedKVSource(cache, SRC_BLOCKS, NUM_TOKENS, lambda blocks: None)
    expected = torch.stack([torch.stack(source.read(layer, 0, NUM_TOKENS)) for layer in range(spec.num_layers)]).cpu()
    conn.send((spec, server.put("t1", source, 60), expected))
    while (msg := conn.recv()) is not None:
        if msg == "corrupt":
            server.faults.arm("corrupt")
            conn.send(server.put("t2", PagedKVSource(cache, SRC_BLOCKS, NUM_TOKENS, lambda blocks: None), 60))
        else:
            conn.send(server.stats())
    server.close()


@pytest.mark.gpu
@needs_gpu
@needs_cupy
@pytest.mark.parametrize("mode", ["cuda_ipc", "auto"])
def test_cuda_ipc_moves_blocks_between_two_processes(mode):
    from kv_transfer.client import KVClient
    from kv_transfer.paged import PagedKVSink
    from pdserve.engine.kv_cache import PagedKVCache
    from pdserve.errors import KVTransferError

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_sender, args=(child, "cuda:0"), daemon=True)
    proc.start()
    try:
        spec, handle, expected = parent.recv()
        device = "cuda:1" if NUM_GPUS >= 2 else "cuda:0"  # another GPU where there is one: peer access
        cache = PagedKVCache(spec, 16, BLOCK_SIZE, device=device)
        blocks = [5, 6, 2, 9]
        client = KVClient(mode, node_id="gpu-node")
        assert handle.cuda_ipc and client.fetch(handle, PagedKVSink(cache, blocks, NUM_TOKENS), timeout_s=30) == "cuda_ipc"
        sink_view = PagedKVSink(cache, blocks, NUM_TOKENS)
        got = torch.stack([torch.stack(cache.read(layer, sink_view._slots)) for layer in range(spec.num_layers)]).cpu()
        assert torch.equal(got.view(torch.int16), expected.view(torch.int16))
        parent.send("stats")
        assert parent.recv()["num_held"] == 0  # acknowledged
        parent.send("corrupt")
        bad = parent.recv()
        with pytest.raises(KVTransferError, match="checksum"):
            client.fetch(bad, PagedKVSink(cache, blocks, NUM_TOKENS), timeout_s=30)
        client.close()
    finally:
        parent.send(None)
        proc.join(30)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_engine_on_a_gpu_decodes_batched_prompts_as_generate_does(cuda_graphs):
    from conftest import reference_generate, tiny_model
    from pdserve.engine.engine import Engine, EngineConfig
    from test_engine import assert_all_blocks_free, generate_all, random_prompts

    model = tiny_model("llama").to("cuda")
    config = EngineConfig(num_blocks=64, block_size=16, chunk_size=32, max_num_batched_tokens=64, optimize=cuda_graphs)
    engine = Engine(model, config, frozenset({2}), 512)
    assert engine.kv_cache.k.is_cuda
    assert (engine.runner.graphs is not None) == cuda_graphs  # on by default on a GPU; optimize=False turns it off
    prompts = random_prompts([3, 17, 40, 70], seed=11)
    seqs = generate_all(engine, prompts, 12)
    for seq, prompt in zip(seqs, prompts):
        assert seq.token_ids[len(prompt):] == reference_generate(model, prompt, 12, ignore_eos=True)
    if cuda_graphs:  # every bucket captured at start; the decode steps replayed them (4 sequences, then fewer)
        graphs = engine.runner.graphs
        assert sorted(graphs.steps) == graphs.batch_sizes and all(step.graph is not None for step in graphs.steps.values())
    assert_all_blocks_free(engine)


@pytest.mark.gpu
@needs_gpu
@needs_cupy
@pytest.mark.parametrize("layout", [pytest.param("one_gpu"), pytest.param("two_gpus", marks=[
    pytest.mark.multi_gpu, pytest.mark.skipif(NUM_GPUS < 2, reason=NO_TWO_GPUS)])])
def test_cluster_on_gpus_moves_kv_over_cuda_ipc_and_equals_the_reference(layout, real_model_dir):
    """Prefill and decode pools on GPUs (sharing one, or one each), KV over cuda_ipc."""
    from ray import serve

    from conftest import reference_generate, serve_cluster
    from pdserve.model_loader import load_model, load_tokenizer

    share = 0.5 if layout == "one_gpu" else 1
    pool = {"ray_actor_options": {"num_cpus": 1, "num_gpus": share}, "kv_cache_tokens": 8192}
    config = {"model": {"dtype": "float32", "device": "cuda"}, "router": {"grpc_port": 9190, "http_port": 8190},
              "prefill": pool, "decode": pool, "kv_transfer": {"backend": "cuda_ipc"}}
    model, tokenizer = load_model(real_model_dir, "float32", "cuda"), load_tokenizer(real_model_dir)
    prompts = [tokenizer(t).input_ids for t in ("The capital of France is", "List three primary colours:", "def fibonacci(n):")]
    cluster_gen = serve_cluster(config, num_gpus=NUM_GPUS)
    client = next(cluster_gen)
    try:
        for prompt in prompts:
            want = reference_generate(model, prompt, 8, ignore_eos=True)
            assert client.generate(prompt_token_ids=prompt, max_tokens=8, ignore_eos=True).token_ids == want
        decode = serve.get_deployment_handle("decode", app_name="pdserve").stats.remote().result()
        assert decode["kv_num_fetched_cuda_ipc"] == len(prompts)
    finally:
        next(cluster_gen, None)


@pytest.mark.gpu
@needs_gpu
def test_a_pool_sized_by_memory_takes_the_fraction_left_after_the_weights_and_a_step():
    from conftest import reference_generate, tiny_model
    from pdserve.engine.engine import Engine, EngineConfig
    from test_engine import assert_all_blocks_free, generate_all, random_prompts

    model = tiny_model("llama").to("cuda")
    torch.cuda.empty_cache()
    free_before = torch.cuda.mem_get_info()[0]
    engine = Engine(model, EngineConfig(num_blocks=0, kv_cache_memory_fraction=0.05), frozenset({2}), 512)
    pool = engine.kv_cache.nbytes
    assert engine.config.num_blocks > 0 and 0.04 * free_before < pool <= 0.05 * free_before  # a tiny model's step is small
    prompts = random_prompts([3, 40], seed=12)
    seqs = generate_all(engine, prompts, 8)
    for seq, prompt in zip(seqs, prompts):
        assert seq.token_ids[len(prompt):] == reference_generate(model, prompt, 8, ignore_eos=True)
    assert_all_blocks_free(engine)
    del engine
    torch.cuda.empty_cache()
