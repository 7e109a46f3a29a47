"""End to end with ``kv_transfer.layerwise: true`` on a real Ray Serve cluster (real model,
float32): decode is called as soon as prefill has scheduled the prompt and fetches each
layer as it is written; greedy output still equals ``model.generate``, and clients that
leave at any moment leave nothing held."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import reference_generate, serve_cluster
from test_e2e import leave_streams, pool_stats, reference, strip_eos, text_prompt, wait_until_idle  # noqa: F401 - reference is a fixture

pytestmark = pytest.mark.e2e
GRPC_PORT, HTTP_PORT = 9180, 8180


@pytest.fixture(scope="module")
def cluster():
    config = {"model": {"dtype": "float32"}, "router": {"grpc_port": GRPC_PORT, "http_port": HTTP_PORT,
                                                        "local_prefill_queue_s": None},  # every prompt streams its KV layer by layer
              "kv_transfer": {"backend": "grpc", "layerwise": True},
              "prefill": {"kv_cache_tokens": 16384}, "decode": {"kv_cache_tokens": 16384}}  # half the default: less to map at start
    yield from serve_cluster(config)


def router_stats() -> dict:
    from ray import serve

    return serve.get_deployment_handle("router", app_name="pdserve").stats.remote().result()


def test_layerwise_greedy_equals_reference_alone_and_concurrently(cluster, reference):
    model, tokenizer = reference
    prompts = [text_prompt(tokenizer, n) for n in (15, 300, 40, 120, 7, 64)]
    wants = [strip_eos(reference_generate(model, p, 12), tokenizer.eos_token_id)[0] for p in prompts]
    assert cluster.generate(prompt_token_ids=prompts[1], max_tokens=12).token_ids == wants[1]
    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda p: cluster.generate(prompt_token_ids=p, max_tokens=12).token_ids, prompts))
    assert got == wants
    assert cluster.generate(prompt_token_ids=prompts[0], max_tokens=1).token_ids == wants[0][:1]  # prefill alone
    prefill, decode = wait_until_idle(30, prefill_too=True)
    assert decode["kv_num_fetched_grpc"] >= len(prompts) + 1 and decode["num_kv_faults"] == 0
    assert router_stats()["num_resent"] == 0


def test_layerwise_first_token_stop_is_an_empty_answer_and_no_kv_fault(cluster, reference):
    """Decode was already fetching when prefill's first token ended the request."""
    model, tokenizer = reference
    prompt = text_prompt(tokenizer, 300)
    first = reference_generate(model, prompt, 1)[0]
    before = pool_stats("decode")
    got = cluster.generate(prompt_token_ids=prompt, max_tokens=16, stop_token_ids=[first])
    assert got.token_ids == [] and got.finish_reason == "stop"
    prefill, decode = wait_until_idle(30, prefill_too=True)
    assert decode["num_kv_faults"] == before["num_kv_faults"] and decode["num_steps"] == before["num_steps"]
    assert prefill["num_held"] == 0 and router_stats()["num_resent"] == 0


def test_layerwise_clients_that_leave_during_prefill_or_the_fetch_free_everything(cluster, reference):
    _, tokenizer = reference
    leave_streams(cluster, text_prompt(tokenizer, 400), 32, (0.0, 0.05, 0.1, 0.2, 0.4, 0.8))
    prefill, decode = wait_until_idle(60, prefill_too=True)
    assert prefill["num_held"] == 0 and prefill["num_used_blocks"] == 0
    assert decode["num_running"] == 0 and decode["num_waiting"] == 0 and decode["num_used_blocks"] == 0
