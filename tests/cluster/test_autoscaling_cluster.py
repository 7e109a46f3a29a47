"""Each pool scales on its own signal on a real local Ray Serve cluster: up under load,
back down after it, without flapping (pdserve.autoscaling.PoolAutoscaler through Ray
Serve's custom autoscaling policy; delays shortened so the test takes about two minutes)."""

from __future__ import annotations

import threading
import time

import pytest

from conftest import serve_cluster

pytestmark = pytest.mark.e2e
GRPC_PORT, HTTP_PORT = 9150, 8150
FAST = {"min_replicas": 1, "max_replicas": 2, "upscale_delay_s": 2.0, "downscale_delay_s": 8.0,
        "metrics_interval_s": 0.5, "look_back_period_s": 2.0}
POOL = {"ray_actor_options": {"num_cpus": 0.5}, "kv_cache_tokens": 8192}
LOAD_S, NUM_CLIENTS = 60.0, 12
# half the clients keep prefill busy (long prompts, 1 token out), half keep decode busy (short prompts, long outputs)
SHAPES = [(1000, 1), (32, 160)]  # max_tokens 1: answered by prefill alone


@pytest.fixture(scope="module")
def cluster():
    yield from serve_cluster({
        "router": {"grpc_port": GRPC_PORT, "http_port": HTTP_PORT},
        # prefill wants a second replica above 512 queued prompt tokens, decode above 1 request each
        "prefill": {**POOL, "autoscaling_config": FAST, "autoscaling_policy": {"target_queued_tokens": 512}},
        "decode": {**POOL, "autoscaling_config": FAST, "autoscaling_policy": {"target_running": 1}},
    })


def running_replicas() -> dict[str, int]:
    from ray import serve

    deployments = serve.status().applications["pdserve"].deployments
    return {name: sum(n for state, n in deployments[name].replica_states.items() if str(getattr(state, "value", state)) == "RUNNING")
            for name in ("prefill", "decode")}


def collapse(values: list[int]) -> list[int]:
    """[1, 1, 2, 2, 1] -> [1, 2, 1]: the sequence of sizes a pool went through."""
    return [v for i, v in enumerate(values) if i == 0 or v != values[i - 1]]


def test_each_pool_scales_up_under_load_and_back_down_after_without_flapping(cluster):
    import random

    stop_load, errors, num_done = threading.Event(), [], [0]

    def client_loop(seed: int):
        rng = random.Random(seed)
        while not stop_load.is_set():
            try:  # a new prompt each time: prefix caching must not make prefill free
                num_prompt, num_out = SHAPES[seed % 2]
                prompt_ids = [rng.randrange(1000, 30000) for _ in range(num_prompt)]
                result = cluster.generate(prompt_token_ids=prompt_ids, max_tokens=num_out, ignore_eos=True, timeout_s=300)
                assert len(result.token_ids) == num_out
                num_done[0] += 1
            except Exception as e:  # noqa: BLE001 - collected and asserted below
                errors.append(e)
                return

    samples: list[tuple[float, dict[str, int]]] = []
    stop_sampling = threading.Event()

    def sample():
        while not stop_sampling.wait(0.5):
            samples.append((time.monotonic(), running_replicas()))

    assert running_replicas() == {"prefill": 1, "decode": 1}
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    clients = [threading.Thread(target=client_loop, args=(i,), daemon=True) for i in range(NUM_CLIENTS)]
    for c in clients:
        c.start()
    time.sleep(LOAD_S)
    stop_load.set()
    load_stopped = time.monotonic()
    for c in clients:
        c.join(150)
    load_ended = time.monotonic()
    assert not errors, errors[:3]
    deadline = load_ended + 90
    while time.monotonic() < deadline and not (samples and samples[-1][1] == {"prefill": 1, "decode": 1}):
        time.sleep(1)
    stop_sampling.set()
    sampler.join(5)

    for pool in ("prefill", "decode"):
        sizes = [s[pool] for _, s in samples]
        # up once under load, down once after it, nothing in between
        changes = [(round(t - load_stopped, 1), s) for i, (t, s) in enumerate(samples) if i == 0 or s != samples[i - 1][1]]
        assert collapse(sizes) == [1, 2, 1], (pool, changes, f"load stopped at 0, drained at {load_ended - load_stopped:.1f}", num_done[0])
        first_down = next(t for i, (t, s) in enumerate(samples) if s[pool] == 1 and i and samples[i - 1][1][pool] == 2)
        assert first_down > load_stopped, f"{pool} shrank while the load was still on"
    assert num_done[0] >= NUM_CLIENTS
