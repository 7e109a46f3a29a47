"""Cancels on 2 prefill + 2 decode replicas.

- A storm of gRPC cancels: 64 SDK streams, each cancelled at a random stage (before its
  first token, right after it, mid-stream). Within 5 s of the last cancel every replica of
  both pools is back at baseline: no request running or waiting, no KV lease held, no block
  used, and the router has nothing in flight.
- Calls by request id (decode's abort, prefill's release: the router's backstops) reach the
  replica that holds the request (router/holder_routing.py), 8 of 8 each: by chance that
  would be 1 in 256."""

from __future__ import annotations

import random
import threading
import time

import pytest

from conftest import serve_cluster

pytestmark = pytest.mark.e2e
GRPC_PORT, HTTP_PORT = 9170, 8170
NUM_STREAMS, SETTLE_S = 64, 5.0
POOL = {"autoscaling_config": {"min_replicas": 2, "max_replicas": 2}, "ray_actor_options": {"num_cpus": 0.5},
        "kv_cache_tokens": 8192, "max_num_seqs": 64}


@pytest.fixture(scope="module")
def cluster():
    yield from serve_cluster({
        "model": {"max_model_len": 1024},
        "router": {"grpc_port": GRPC_PORT, "http_port": HTTP_PORT, "local_prefill_queue_s": None},
        "prefill": POOL, "decode": POOL,
    })


def replica_stats(deployment: str, want: int = 2, tries: int = 60) -> dict[str, dict]:
    """Stats of every replica of ``deployment`` (calls go to a random replica: ask until
    ``want`` distinct ones have answered)."""
    from ray import serve

    handle, seen = serve.get_deployment_handle(deployment, "pdserve"), {}
    for _ in range(tries):
        s = handle.stats.remote().result(timeout_s=30)
        seen[s["replica"]] = s
        if len(seen) == want:
            break
    assert len(seen) == want, f"only {len(seen)} {deployment} replicas answered"
    return seen


def idle(prefill: dict, decode: dict, router: dict) -> bool:
    return (all(s["num_running"] == s["num_waiting"] == s["num_held"] == 0 and s["num_free_blocks"] == s["num_blocks"] for s in prefill.values())
            and all(s["num_running"] == s["num_waiting"] == 0 and s["num_free_blocks"] == s["num_blocks"] for s in decode.values())
            and router["num_in_flight"] == 0)


def test_aborts_and_releases_by_id_reach_the_replica_that_holds_the_request(cluster):
    from ray import serve

    from pdserve.messages import DecodeRequest, PrefillRequest
    from pdserve.sampling import SamplingParams

    decode, prefill = serve.get_deployment_handle("decode", "pdserve"), serve.get_deployment_handle("prefill", "pdserve")
    prompt = lambda i: [2000 + i * 13 + k for k in range(40)]  # noqa: E731
    streams = {f"held-d{i}": decode.options(stream=True).generate.remote(
        DecodeRequest(f"held-d{i}", prompt(i), None, SamplingParams(max_tokens=500, ignore_eos=True), None)) for i in range(8)}
    for stream in streams.values():
        next(stream)  # the first token: decoding now, on one of the two replicas
    assert [decode.abort.remote(rid).result(timeout_s=30) for rid in streams] == [True] * 8
    for stream in streams.values():
        chunks = list(stream)
        assert chunks[-1].finish_reason == "abort" and sum(len(c.token_ids) for c in chunks) < 499
    results = [prefill.prefill.remote(PrefillRequest(f"held-p{i}", prompt(i), SamplingParams(max_tokens=8))).result(timeout_s=60)
               for i in range(8)]
    assert all(r.kv is not None for r in results)  # each leased on one of the two replicas
    assert [prefill.release.remote(f"held-p{i}").result(timeout_s=30) for i in range(8)] == [True] * 8
    assert sum(s["num_aborted_by_id"] for s in replica_stats("decode").values()) == 8
    assert all(s["num_held"] == 0 for s in replica_stats("prefill").values())


def test_64_cancels_at_random_stages_leave_every_replica_idle(cluster):
    from ray import serve

    rng = random.Random(7)
    stages = [rng.choice(["before", "first", "mid"]) for _ in range(NUM_STREAMS)]
    got = [0] * NUM_STREAMS
    errors: list[BaseException] = []

    def one(i: int) -> None:
        prompt = [1000 + (i * 37 + k) % 20000 for k in range(rng.randint(40, 300))]
        stream = cluster.stream(prompt_token_ids=prompt, max_tokens=600, ignore_eos=True, timeout_s=120)
        try:
            if stages[i] == "before":
                time.sleep(0.01)
                stream.cancel()
            after = {"before": 0, "first": 1, "mid": 1 + (i % 5) * 8}[stages[i]]
            for chunk in stream:
                got[i] += len(chunk.token_ids)
                if got[i] >= after and stages[i] != "before":
                    stream.cancel()
                    break
        except Exception as e:  # noqa: BLE001 - collected and failed on below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(NUM_STREAMS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors[:3]
    assert all(n < 600 for n in got), "a stream ran to max_tokens: its cancel was not needed"
    deadline, router = time.monotonic() + SETTLE_S, serve.get_deployment_handle("router", "pdserve")
    while True:
        prefill, decode, front = replica_stats("prefill"), replica_stats("decode"), router.stats.remote().result(timeout_s=30)
        if idle(prefill, decode, front) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert idle(prefill, decode, front), (prefill, decode, front)
