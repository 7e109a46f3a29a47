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
from test_failures import generate_through_a_prefill_kill, prompt, router_stats

pytestmark = pytest.mark.e2e
GRPC_PORT, HTTP_PORT = 9190, 8190


@pytest.fixture(scope="module")
def cluster():
    yield from serve_cluster({
        "model": {"dtype": "float32"}, "router": {"grpc_port": GRPC_PORT, "http_port": HTTP_PORT, "retry_backoff_s": 0.2},
        "prefill": {"autoscaling_config": {"min_replicas": 2, "max_replicas": 2}, "ray_actor_options": {"num_cpus": 0.5}, "kv_cache_tokens": 8192},
        "decode": {"kv_cache_tokens": 8192},
        "kv_transfer": {"backend": "grpc", "layerwise": True},
    })


@pytest.fixture(scope="module")
def model(real_model_dir):
    from pdserve.model_loader import load_model

    torch.set_num_threads(1)
    return load_model(real_model_dir, "float32")


def test_a_prefill_replica_killed_while_decode_streams_its_layers_is_retried_on_the_other(cluster, model):
    prompts = [prompt(i + 40, 700) for i in range(6)]  # long prompts: decode fetches while both replicas compute
    generate_through_a_prefill_kill(cluster, model, prompts, 6)
    assert router_stats()["num_prefill_retries"] > 0
    deadline = time.monotonic() + 60
    while True:  # decode let go of everything it reserved for the dead replica's KV
        decode = pool_stats("decode")
        if (decode["num_running"], decode["num_waiting"], decode["num_used_blocks"]) == (0, 0, 0) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert (decode["num_running"], decode["num_waiting"], decode["num_used_blocks"]) == (0, 0, 0)
