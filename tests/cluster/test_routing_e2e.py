"""Routing on a real cluster of 2 prefill replicas and 1 decode replica.

Prefix-aware routing (router/prefix_routing.py): prompts sharing a system prompt go to the
replica that cached it; distinct prompts spread over both. Conditional disaggregation
(router.local_prefill_max_tokens): short prompts are prefilled by the decode replica itself.
Greedy ids equal model.generate either way, and nothing is left held."""

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
    half = {"num_cpus": 0.5, "num_gpus": 0, "resources": {}}
    two = {"min_replicas": 2, "max_replicas": 2, "upscale_delay_s": 10, "downscale_delay_s": 60, "look_back_period_s": 30}
    config = {"model": {"dtype": "float32"}, "router": {"grpc_port": GRPC_PORT, "http_port": HTTP_PORT, "local_prefill_max_tokens": 32,
                                                        "local_prefill_queue_s": None},  # placement by length alone: what these tests count
              "prefill": {"autoscaling_config": two, "ray_actor_options": half, "kv_cache_tokens": 16384},
              "decode": {"kv_cache_tokens": 16384}}  # half the default pools: less to map at start
    yield from serve_cluster(config)


@pytest.fixture(scope="module")
def reference(real_model_dir):
    from pdserve.model_loader import load_model, load_tokenizer

    torch.set_num_threads(1)
    return load_model(real_model_dir, "float32"), load_tokenizer(real_model_dir)


def stats(name: str) -> dict:
    from ray import serve

    return serve.get_deployment_handle(name, app_name="pdserve").stats.remote().result()


def prefill_replicas() -> dict[str, dict]:
    """Each prefill replica's stats, by replica id (a call without a prompt may go to either)."""
    seen: dict[str, dict] = {}
    for _ in range(200):
        s = stats("prefill")
        seen[s["replica"]] = s
        if len(seen) == 2:
            return seen
    raise AssertionError(f"only replicas {sorted(seen)} answered")


def delta(after: dict, before: dict, key: str) -> dict[str, int]:
    return {r: after[r][key] - before[r][key] for r in after}


def test_a_shared_system_prompt_stays_on_its_replica_and_distinct_prompts_spread(cluster, reference):
    model, tokenizer = reference
    ids = tokenizer("Rules of the archive: every visitor signs the book, no ink near the maps, gloves for the charters, "
                    "and questions go to the duty archivist, who answers them in the order they came. " * 8).input_ids
    system = ids[:160]  # 10 blocks of 16
    before = prefill_replicas()
    for i in range(5):  # one after another: each finds the system prompt where the first went
        prompt = system + ids[200 + 10 * i: 210 + 10 * i]
        assert cluster.generate(prompt_token_ids=prompt, max_tokens=4, ignore_eos=True).token_ids == reference_generate(
            model, prompt, 4, ignore_eos=True)
    after = prefill_replicas()
    hits, computed = delta(after, before, "num_prefix_hit_blocks"), delta(after, before, "num_tokens_computed")
    assert sorted(hits.values()) == [0, 40], hits  # 4 requests x 10 cached blocks, all on one replica
    assert sorted(computed.values()) == [0, 170 + 4 * 10], computed  # the other computed nothing
    words = tokenizer("".join(f"Item {i}: a crate of {i * 7} pears shipped to the harbour of town number {i * 13}. " for i in range(400))).input_ids
    prompts = [words[300 * i: 300 * i + 300] for i in range(8)]  # distinct from their first block on
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda p: cluster.generate(prompt_token_ids=p, max_tokens=2, ignore_eos=True), prompts))
    spread = delta(prefill_replicas(), after, "num_tokens_computed")
    # both replicas take some (how many depends on when each finishes: the cost counts queued tokens)
    assert min(spread.values()) >= 300 and sum(spread.values()) == 8 * 300, spread


def test_short_prompts_prefill_on_decode_and_equal_the_reference(cluster, reference):
    model, tokenizer = reference
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
    prefill_before = prefill_replicas()
    assert cluster.generate(prompt_token_ids=ids[:8], max_tokens=4).completion_tokens >= 1
    assert set(delta(prefill_replicas(), prefill_before, "num_tokens_computed").values()) == {0}  # the prefill pool never saw it


def test_nothing_is_left_held_or_running(cluster):
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        prefill, decode = prefill_replicas(), stats("decode")
        held = sum(s["num_held"] + s["num_running"] + s["num_used_blocks"] for s in prefill.values())
        if held == 0 and decode["num_running"] == 0 and decode["num_used_blocks"] == 0:
            break
        time.sleep(0.25)
    assert held == 0 and (decode["num_running"], decode["num_waiting"], decode["num_used_blocks"]) == (0, 0, 0)

