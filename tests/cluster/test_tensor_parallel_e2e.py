"""Tensor parallelism on a real Ray Serve cluster (float32): a prefill pool at TP=2 hands off
over shm to a decode pool at TP=1, from a tiny random Llama of 8 heads and 4 KV heads written
with the bundled tokenizer. Greedy ids equal HF ``model.generate``. Then one rank of the
prefill replica is killed: the replica fails its health check, Ray Serve replaces it, and the
requests sent meanwhile are retried and answer the same ids, with the pools' blocks and
leases back at baseline."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import reference_generate, serve_cluster

pytestmark = pytest.mark.e2e

GRPC_PORT, HTTP_PORT = 9220, 8220
PROMPTS = [[1, *range(100 + 3 * n, 100 + 4 * n)] for n in (5, 31, 40)]
RANK_PROCESS = "ray::TPRankActor"  # a rank > 0 is a Ray actor in the replica's placement group


@pytest.fixture(scope="module")
def setup(tmp_path_factory, real_model_dir):
    path = tmp_path_factory.mktemp("tp_e2e")
    torch.manual_seed(3)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                                         num_key_value_heads=4, head_dim=16, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                                         pad_token_id=0)).eval()
    model.save_pretrained(path)
    for name in real_model_dir.glob("*"):
        if name.name.startswith(("tokenizer", "special_tokens")) or name.suffix == ".jinja":
            shutil.copy(name, path / name.name)
    want = [reference_generate(model, p, 16, ignore_eos=True) for p in PROMPTS]
    pool = {"kv_cache_tokens": 1024, "block_size": 4, "num_threads": 1, "health_check_period_s": 1, "health_check_timeout_s": 5,
            "ray_actor_options": {"num_cpus": 0.5}}  # per rank: prefill's placement group holds 2 x 0.5 CPUs
    config = {"model": {"path": str(path), "dtype": "float32", "max_model_len": 256},
              "prefill": {**pool, "tensor_parallel_size": 2}, "decode": pool, "kv_transfer": {"backend": "shm"},
              "router": {"grpc_port": GRPC_PORT, "http_port": HTTP_PORT, "retry_backoff_s": 0.2}}
    cluster = serve_cluster(config)
    client = next(cluster)
    yield client, want
    next(cluster, None)  # shuts it down


def rank_pids() -> list[int]:
    out = subprocess.run(["pgrep", "-f", RANK_PROCESS], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def pool_stats(pool: str) -> dict:
    from ray import serve

    return serve.get_deployment_handle(pool, "pdserve").stats.remote().result(timeout_s=30)


def test_prefill_at_tp2_hands_off_to_decode_at_tp1_and_equals_hf_generate(setup):
    client, want = setup
    assert len(rank_pids()) == 1  # the prefill replica's rank 1
    assert [client.generate(prompt_token_ids=p, max_tokens=16, ignore_eos=True).token_ids for p in PROMPTS] == want


def test_a_killed_rank_gets_its_replica_replaced_and_requests_retried(setup):
    client, want = setup
    (victim,) = rank_pids()
    subprocess.run(["kill", f"-{signal.SIGKILL.value}", str(victim)], check=True)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = [pool.submit(client.generate, prompt_token_ids=p, max_tokens=16, ignore_eos=True, timeout_s=180) for p in PROMPTS]
        assert [f.result().token_ids for f in futures] == want
    deadline = time.monotonic() + 120
    while (pids := rank_pids()) in ([], [victim]) and time.monotonic() < deadline:  # the new replica's rank
        time.sleep(1)
    assert pids and victim not in pids
    prefill, decode = pool_stats("prefill"), pool_stats("decode")
    assert prefill["num_held"] == 0 and prefill["num_free_blocks"] == prefill["num_blocks"]
    assert decode["num_free_blocks"] == decode["num_blocks"]
