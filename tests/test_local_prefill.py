"""Conditional disaggregation on a real cluster: short prompts prefilled by the decode
replica itself (router.local_prefill_max_tokens), long ones by the prefill pool; greedy ids
equal model.generate either way, and nothing is left held."""

from __future__ import annotations

import concurrent.futures
import time

import pytest
import torch

from conftest import reference_generate, serve_cluster

pytestmark = pytest.mark.e2e

GRPC_PORT, HTTP_PORT = 9130, 8130


@pytest.fixture(scope="module")
def cluster():
    config = {"model": {"dtype": "float32"}, "router": {"grpc_port": GRPC_PORT, "http_port": HTTP_PORT, "local_prefill_max_tokens": 32}}
    yield from serve_cluster(config)


def stats(name: str) -> dict:
    from ray import serve

    return serve.get_deployment_handle(name, app_name="pdserve").stats.remote().result()


def test_short_prompts_prefill_on_decode_and_equal_the_reference(cluster, real_model_dir):
    from pdserve.model_loader import load_model, load_tokenizer

    torch.set_num_threads(1)
    model, tokenizer = load_model(real_model_dir, "float32"), load_tokenizer(real_model_dir)
    ids = tokenizer("A lighthouse keeper wrote down the weather every hour for forty years, and the logbooks now "
                    "fill a whole room of the town museum, where visitors read them for the storms. " * 4).input_ids
    prompts = [ids[:5], ids[:32], ids[:33], ids[:120]]  # local, local, remote, remote
    before = stats("router")
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda p: cluster.generate(prompt_token_ids=p, max_tokens=12, ignore_eos=True), prompts))
    for prompt, result in zip(prompts, got):
        assert result.token_ids == reference_generate(model, prompt, 12, ignore_eos=True)
    after = stats("router")
    assert after["num_prefill_local_short"] - before["num_prefill_local_short"] == 2
    assert after["num_prefill_remote"] - before["num_prefill_remote"] == 2
    prefill_before = stats("prefill")["num_tokens_computed"]
    assert cluster.generate(prompt_token_ids=ids[:8], max_tokens=4).completion_tokens >= 1
    assert stats("prefill")["num_tokens_computed"] == prefill_before  # the prefill pool never saw it
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        prefill, decode = stats("prefill"), stats("decode")
        if prefill["num_held"] == 0 and decode["num_running"] == 0 and decode["num_used_blocks"] == 0:
            break
        time.sleep(0.25)
    assert (prefill["num_held"], decode["num_running"], decode["num_waiting"], decode["num_used_blocks"]) == (0, 0, 0, 0)
