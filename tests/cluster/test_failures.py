"""Worker failures on a real cluster (issue 7): real replica actors are killed while
requests run. A prefill replica that dies mid-request: the router sends the prefill to the
other replica. A decode replica that dies mid-stream: the request migrates (prompt + tokens
streamed so far recomputed on the other replica). A decode replica whose forward hangs:
its streams migrate once the step outlasts max_step_s, it fails its health check and Ray
Serve replaces it alone. Each way the client sees no error and the greedy output equals the
reference, with no token missing or repeated (float32)."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from conftest import reference_generate, serve_cluster

pytestmark = pytest.mark.e2e
GRPC_PORT, HTTP_PORT = 9170, 8170
TWO = {"autoscaling_config": {"min_replicas": 2, "max_replicas": 2}, "ray_actor_options": {"num_cpus": 0.5}, "kv_cache_tokens": 8192}
HANG_FILE = Path(f"/tmp/pdserve-test-hang-{os.getpid()}")  # a decode replica that finds it hangs (pdserve/engine/loop.py)
PREFILL_HANG_FILE = Path(f"/tmp/pdserve-test-prefill-hang-{os.getpid()}")  # the same, for a prefill replica
PREFILL = {**TWO, "ray_actor_options": {"num_cpus": 0.5, "runtime_env": {"env_vars": {"PDSERVE_FAULT_HANG_FILE": str(PREFILL_HANG_FILE)}}}}
DECODE = {
    **TWO, "max_num_batched_tokens": 512, "max_step_s": 10, "health_check_period_s": 1, "health_check_timeout_s": 5,
    "ray_actor_options": {"num_cpus": 0.5, "runtime_env": {"env_vars": {"PDSERVE_FAULT_HANG_FILE": str(HANG_FILE)}}},
}


@pytest.fixture(scope="module")
def cluster():
    yield from serve_cluster({
        "model": {"dtype": "float32"}, "router": {"grpc_port": GRPC_PORT, "http_port": HTTP_PORT, "retry_backoff_s": 0.2},
        "prefill": PREFILL, "decode": DECODE,
    })


@pytest.fixture(scope="module")
def model(real_model_dir):
    from pdserve.model_loader import load_model

    torch.set_num_threads(1)
    return load_model(real_model_dir, "float32")


def replicas(pool: str) -> list[str]:
    import ray

    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(f"SERVE_REPLICA::pdserve#{pool}#"))


def kill_one(pool: str) -> str:
    import ray

    name = replicas(pool)[0]
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    return name


def router_stats() -> dict:
    from ray import serve

    return serve.get_deployment_handle("router", "pdserve").stats.remote().result(timeout_s=30)


def wait_for_two_running(timeout_s: float = 120, pools: tuple[str, ...] = ("prefill", "decode")) -> None:
    from ray import serve

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        deployments = serve.status().applications["pdserve"].deployments
        running = [sum(n for s, n in deployments[p].replica_states.items() if str(getattr(s, "value", s)) == "RUNNING") for p in pools]
        if running == [2] * len(pools):
            return
        time.sleep(1)
    raise AssertionError(f"pools {pools} not back to 2 replicas: {running}")


def prompt(i: int, n: int) -> list[int]:
    return [1000 + (i * 7919 + j * 104729) % 20000 for j in range(n)]


def generate_through_a_prefill_kill(cluster, model, prompts: list[list[int]], max_tokens: int, hang_file: Path = PREFILL_HANG_FILE) -> None:
    """Generate ``prompts`` at once and SIGKILL the prefill replica that holds one of them, then
    check every answer equals the reference. The pool runs with ``PDSERVE_FAULT_HANG_FILE =
    hang_file``: the first replica to step with work after the file appears takes it and hangs
    in that step (pdserve/engine/loop.py), so the replica killed holds at least one request,
    however fast the machine (a kill at a fixed time once found both queues drained)."""
    cluster.generate(prompt_token_ids=prompts[0][:8], max_tokens=1, timeout_s=120)  # warm the path
    taken = f"{hang_file.name}.taken-by-"
    for old in hang_file.parent.glob(f"{taken}*"):
        old.unlink()
    try:
        with ThreadPoolExecutor(len(prompts)) as pool:
            futures = [pool.submit(cluster.generate, prompt_token_ids=p, max_tokens=max_tokens, ignore_eos=True, timeout_s=300) for p in prompts]
            hang_file.touch()
            deadline = time.monotonic() + 120  # only catches a hang
            while not (found := list(hang_file.parent.glob(f"{taken}*"))):
                assert time.monotonic() < deadline, "no prefill replica took the hang file"
                time.sleep(0.05)
            os.kill(int(found[0].name[len(taken):]), signal.SIGKILL)  # the replica's actor process
            results = [f.result() for f in futures]
    finally:
        hang_file.unlink(missing_ok=True)
        for path in hang_file.parent.glob(f"{taken}*"):
            path.unlink()
    for p, r in zip(prompts, results):
        assert r.token_ids == reference_generate(model, p, max_tokens, ignore_eos=True)


def test_a_prefill_replica_killed_mid_request_is_retried_on_the_other(cluster, model):
    wait_for_two_running()
    before = router_stats()["num_prefill_retries"]
    prompts = [prompt(i, 700) for i in range(6)]  # 4,200 tokens: the survivor's 8,192-token pool takes them all
    generate_through_a_prefill_kill(cluster, model, prompts, 4)
    assert router_stats()["num_prefill_retries"] > before
    wait_for_two_running()


STREAM_TOKENS = 120  # long enough that the streams still run when a fault lands: at 40 a fast machine finished them before a killed replica died


def stream_through(cluster, model, fault, seed: int, with_choices: bool = False) -> None:
    """Stream 4 requests, call ``fault()`` once each has 5 tokens, then check every stream
    equals the reference and at least one migrated. ``with_choices``: a fifth, seeded, of
    n = 3, each choice of which must equal the request with seed + i alone."""
    before = router_stats()["num_migrations"]
    prompts = [prompt(i + seed, 30 + 5 * i) for i in range(4)]
    got: list[list[int]] = [[] for _ in prompts]
    started = [threading.Event() for _ in prompts]
    sampled = dict(prompt_token_ids=prompt(seed + 9, 40), max_tokens=STREAM_TOKENS, temperature=1.0, seed=seed, ignore_eos=True, timeout_s=300)
    choices: dict[int, list[int]] = {0: [], 1: [], 2: []}

    def read(i: int):
        for chunk in cluster.stream(prompt_token_ids=prompts[i], max_tokens=STREAM_TOKENS, ignore_eos=True, timeout_s=300):
            got[i].extend(chunk.token_ids)
            if len(got[i]) >= 5:
                started[i].set()

    def read_choices():
        for chunk in cluster.stream(**sampled, n=3):
            choices[chunk.index].extend(chunk.token_ids)
            if min(map(len, choices.values())) >= 5:
                started[-1].set()

    threads = [threading.Thread(target=read, args=(i,)) for i in range(len(prompts))]
    if with_choices:
        started.append(threading.Event())
        threads.append(threading.Thread(target=read_choices))
    for t in threads:
        t.start()
    for e in started:
        assert e.wait(120)
    fault()
    for t in threads:
        t.join(300)
    for p, tokens in zip(prompts, got):
        assert tokens == reference_generate(model, p, STREAM_TOKENS, ignore_eos=True)
    if with_choices:
        assert choices == {i: cluster.generate(**{**sampled, "seed": seed + i}).token_ids for i in range(3)}
    assert router_stats()["num_migrations"] > before


def test_a_decode_replica_killed_mid_stream_migrates_without_gaps_or_repeats(cluster, model):
    wait_for_two_running()
    stream_through(cluster, model, lambda: kill_one("decode"), seed=10, with_choices=True)
    wait_for_two_running()


def test_a_decode_replica_whose_forward_hangs_is_replaced_alone_and_its_streams_migrate(cluster, model):
    wait_for_two_running()
    decode_before, prefill_before = set(replicas("decode")), replicas("prefill")
    try:
        stream_through(cluster, model, HANG_FILE.touch, seed=20)  # the first decode replica to step next hangs
        taken = list(HANG_FILE.parent.glob(f"{HANG_FILE.name}.taken-by-*"))
        assert len(taken) == 1 and not HANG_FILE.exists()
        deadline = time.monotonic() + 180  # hung 10 s (max_step_s), 3 failed checks 1 s apart, a new replica loads
        while time.monotonic() < deadline and set(replicas("decode")) & decode_before == decode_before:
            time.sleep(1)
        wait_for_two_running()
        survivors = set(replicas("decode")) & decode_before
        assert len(survivors) == 1 and len(replicas("decode")) == 2  # the hung one replaced, its peer kept
        assert replicas("prefill") == prefill_before  # and no prefill replica went with it
    finally:
        HANG_FILE.unlink(missing_ok=True)
        for path in HANG_FILE.parent.glob(f"{HANG_FILE.name}.taken-by-*"):
            path.unlink()
    p = prompt(30, 50)  # the pool serves again, exactly
    assert cluster.generate(prompt_token_ids=p, max_tokens=8, ignore_eos=True, timeout_s=120).token_ids == reference_generate(model, p, 8, ignore_eos=True)
