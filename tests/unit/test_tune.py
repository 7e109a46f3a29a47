"""pdserve tune's prediction (bench/tune.py) on a fixed profile: the split follows the workload."""

import json

from bench import tune

PROFILE = {"model": "smollm2", "dtype": "bfloat16", "context": 300,
           "prefill_s": {"64": 0.15, "256": 0.45, "1024": 2.1, "2048": 5.5},
           "decode_step_s": {"1": 0.06, "4": 0.08, "16": 0.17, "32": 0.3}}


def test_fit_recovers_the_profile_shape():
    (a, b, c), (d, e) = tune.fit(PROFILE)
    assert abs((a + b * 1024 + c * 1024**2) - 2.1) < 0.3 and abs((d + e * 16) - 0.17) < 0.03


def test_simulation_queues_when_overloaded():
    specs = [tune.serve.RequestSpec(256, 20)] * 50
    fits = tune.fit(PROFILE)
    calm_ttft, calm_tpot = tune.simulate(specs, 0.2, 1, 1, *fits)
    busy_ttft, _ = tune.simulate(specs, 20.0, 1, 1, *fits)
    assert max(calm_ttft) < 1.0 and sorted(busy_ttft)[-1] > 10 * max(calm_ttft)
    assert all(0.05 <= t <= 0.1 for t in calm_tpot)  # alone or nearly: batch 1-2 step times


def test_chat_wants_decode_replicas_and_long_prompts_want_prefill(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(PROFILE))
    common = ["--profile", str(path), "--workers", "4", "--num-requests", "150", "--out", str(tmp_path)]
    chat = tune.main([*common, "--dataset", "chat"])
    long = tune.main([*common, "--dataset", "long", "--ttft-slo", "20"])
    best = lambda r: (r["splits"][0]["prefill"], r["splits"][0]["decode"])  # noqa: E731
    assert best(chat)[1] > best(chat)[0] and best(long)[0] > best(long)[1]
    assert "min_replicas: 3" in (tmp_path / "cluster-fragment.yaml").read_text()  # the last run's (long: 3 prefill)
