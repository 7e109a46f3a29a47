"""A prefill replica killed mid-request with ``kv_transfer.layerwise: true`` (issue 4, 7),
on a real cluster (real model, float32): decode was already fetching the KV the dead replica
was computing. The router stops that decode call, frees what it held and sends the prefill
to the other replica; the client sees no error, the greedy output equals the reference, and
the decode pool holds nothing afterwards."""

from __future__ import annotations

import time

import pytest
import torch

from conftest import serve_cluster
from test_e2e import pool_stats
from test_failures import PREFILL, generate_through_a_prefill_kill, prompt, router_stats, wait_for_two_running

pytestmark = pytest.mark.e2e
GRPC_PORT, HTTP_PORT = 9190, 8190


@pytest.fixture(scope="module")
def cluster():
    yield from serve_cluster({
        "model": {"dtype": "float32"}, "router": {"grpc_port": GRPC_PORT, "http_port": HTTP_PORT, "retry_backoff_s": 0.2},
        "prefill": PREFILL,
        "decode": {"kv_cache_tokens": 8192},
        "kv_transfer": {"backend": "grpc", "layerwise": True},
    })


@pytest.fixture(scope="module")
def model(real_model_dir):
    from pdserve.model_loader import load_model

    torch.set_num_threads(1)
    return load_model(real_model_dir, "float32")


def test_a_prefill_replica_killed_while_decode_streams_its_layers_is_retried_on_the_other(cluster, model):
    wait_for_two_running(pools=("prefill",))
    prompts = [prompt(i + 40, 700) for i in range(6)]  # long prompts: decode fetches while a replica computes
    generate_through_a_prefill_kill(cluster, model, prompts, 6)
    assert router_stats()["num_prefill_retries"] > 0
    deadline = time.monotonic() + 60
    while True:  # decode let go of everything it reserved for the dead replica's KV
        decode = pool_stats("decode")
        if (decode["num_running"], decode["num_waiting"], decode["num_used_blocks"]) == (0, 0, 0) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert (decode["num_running"], decode["num_waiting"], decode["num_used_blocks"]) == (0, 0, 0)


def test_a_router_killed_during_layerwise_hand_offs_leaves_nothing_in_either_pool(cluster):
    """The router replica dies while both prefill replicas compute long prompts layer by layer
    and decode fetches them: each pool stops the dead router's requests it holds (pdserve/callers.py),
    with nothing left running, reserved, held or leased, and a new router replica serves."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import grpc
    import ray

    from bench.soak import replica_stats
    from pdserve.client import Client
    from test_failures import replicas

    wait_for_two_running(pools=("prefill",))  # both prefill replicas compute (the test before killed one)
    prompts = [prompt(i + 60, 700) for i in range(6)]
    cluster.generate(prompt_token_ids=prompts[0][:8], max_tokens=1, timeout_s=120)  # warm the path

    def stopped() -> int:  # requests either pool's caller watch stopped: a prompt still computing
        # stops in prefill, one already handed off stops in decode (how many of each is timing)
        return sum(s["num_stopped_for_dead_caller"] for s in replica_stats("prefill").values()) + pool_stats("decode")["num_stopped_for_dead_caller"]

    before = stopped()
    client, first = Client(f"127.0.0.1:{GRPC_PORT}", retries=0), threading.Event()

    def stream(p: list[int]) -> str:
        try:
            for _ in client.stream(prompt_token_ids=p, max_tokens=300, ignore_eos=True, timeout_s=300):
                first.set()
            return "finished"
        except grpc.RpcError as e:
            return e.code().name

    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(stream, p) for p in prompts]
        assert first.wait(300)  # one prompt is done; the others are still prefilling, their KV streaming to decode
        ray.kill(ray.get_actor(replicas("router")[0], namespace="serve"), no_restart=True)
        outcomes = [f.result(timeout=300) for f in futures]
    assert outcomes == ["UNAVAILABLE"] * len(prompts), outcomes
    deadline = time.monotonic() + 120  # only catches a hang
    while True:
        prefill, decode = replica_stats("prefill"), pool_stats("decode")
        idle = all(s["num_running"] == s["num_waiting"] == s["num_held"] == 0 and s["num_free_blocks"] == s["num_blocks"] for s in prefill.values())
        if (idle and (decode["num_running"], decode["num_waiting"], decode["num_used_blocks"]) == (0, 0, 0)) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert idle and (decode["num_running"], decode["num_waiting"], decode["num_used_blocks"]) == (0, 0, 0), (prefill, decode)
    assert stopped() > before  # stopped by the watch, not finished
    while True:  # Ray Serve starts a new router replica
        try:
            assert cluster.generate(prompt_token_ids=prompts[0][:8], max_tokens=2, timeout_s=60).completion_tokens == 2
            break
        except grpc.RpcError:
            assert time.monotonic() < deadline + 120, "no new router replica"
            time.sleep(1)
    client.close()
