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
    # every prompt through prefill (DistServe's model): with conditional disaggregation decode
    # replicas prefill too, and the split matters less
    common = ["--profile", str(path), "--workers", "4", "--num-requests", "150", "--out", str(tmp_path), "--local-prefill-queue-s", "none"]
    chat = tune.main([*common, "--dataset", "chat"])
    long = tune.main([*common, "--dataset", "long", "--ttft-slo", "20"])
    best = lambda r: (r["splits"][0]["prefill"], r["splits"][0]["decode"])  # noqa: E731
    assert best(chat)[1] > best(chat)[0] and best(long)[0] > best(long)[1]
    fragment = (tmp_path / "cluster-fragment.yaml").read_text()  # the last run's (long: 3 prefill)
    assert "min_replicas: 3" in fragment and "local_prefill_queue_s: null" in fragment


def test_colocated_alone_is_the_prefill_in_chunks_then_single_steps():
    """One request at a time: its prompt runs in chunks of the budget (each a forward that
    pays ``a`` and its chunk's share), its first token comes with the last chunk, and each
    later token takes a batch-1 step."""
    (a, b, c), (d, e) = fits = tune.fit(PROFILE)
    spec = tune.serve.RequestSpec(700, 5)
    ttft, tpot = tune.simulate_colocated([spec], 0.001, *fits, budget=512)
    first, second = a + b * 512 + c * 512**2, a + b * 188 + c * (700**2 - 512**2)
    assert abs(ttft[0] - (first + second)) < 1e-12
    assert abs(tpot[0] - (d + e)) < 1e-12


def test_colocated_decodes_share_each_step_with_the_next_prompt_chunk():
    """Under load the steps hold both: a decoding request's TPOT includes its neighbours'
    prompt chunks, so it rises with the rate, and the prediction's goodput falls with a
    tighter TPOT SLO."""
    specs = [tune.serve.RequestSpec(300, 40)] * 80
    fits = tune.fit(PROFILE)
    _, calm = tune.simulate_colocated(specs, 0.05, *fits)
    _, busy = tune.simulate_colocated(specs, 2.0, *fits)
    assert max(calm) < sorted(busy)[len(busy) // 2]
    loose = tune.predicted_goodput(specs, 0, 512, *fits, ttft_slo=5.0, tpot_slo=1.0, target=0.9)
    tight = tune.predicted_goodput(specs, 0, 512, *fits, ttft_slo=5.0, tpot_slo=0.1, target=0.9)
    assert 0 < tight < loose


def test_tune_predicts_colocated_from_a_profile_on_all_cores(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"1": PROFILE, "2": PROFILE}))
    result = tune.main(["--profile", str(path), "--workers", "2", "--num-requests", "100", "--out", str(tmp_path)])
    assert result["colocated"]["threads"] == 2 and result["colocated"]["predicted_goodput_rps"] > 0


def test_decode_yielding_waits_out_each_prefill_at_most_yield_s(monkeypatch):
    """``yield_s`` (decode.yield_to_prefill_s): arrivals at 0 and 1, prefill a = 0.5 s, decode
    steps d = 0.125 s (binary fractions: exact sums). The second prompt's prefill runs over
    [1, 1.5) while the first request decodes its 7 steps from 0.5. Waiting, its step due at 1
    starts at 1.5; capped at 0.25 s, it starts at 1.25, and the next, due at 1.375, waits to
    1.5. Prefill never waits for decode."""

    class Arrivals:
        def __init__(self, seed):
            self.gaps = iter([0.0, 1.0])

        def expovariate(self, rate):
            return next(self.gaps)

    monkeypatch.setattr(tune.random, "Random", Arrivals)
    specs, fits = [tune.serve.RequestSpec(1, 8), tune.serve.RequestSpec(1, 2)], ((0.5, 0.0, 0.0), (0.125, 0.0))
    free_ttft, free_tpot = tune.simulate(specs, 1.0, 1, 1, *fits)
    wait_ttft, wait_tpot = tune.simulate(specs, 1.0, 1, 1, *fits, yield_s=10.0)
    capped_ttft, capped_tpot = tune.simulate(specs, 1.0, 1, 1, *fits, yield_s=0.25)
    assert free_ttft == wait_ttft == capped_ttft == [0.5, 0.5]
    assert free_tpot[0] == 0.875 / 7
    assert wait_tpot[0] == (0.875 + 0.5) / 7
    assert capped_tpot[0] == (0.875 + 0.25 + 0.125) / 7


def test_calibration_scales_the_fits_to_the_lone_request_measured():
    """``calibrate``: binary fractions, so exact. The profile's lone request (256 tokens)
    takes a + 256 b + 256^2 c = 0.25 s and d + e = 0.0625 s; measured 0.5 s and 0.078125 s,
    every prefill coefficient doubles and every decode one takes 1.25x. A lone request then
    simulates to exactly the measured TTFT and TPOT; a missing figure leaves its fit alone."""
    prefill, decode = (0.125, 0.25 / 512, 0.0), (0.03125, 0.03125)
    (a, b, c), (d, e) = tune.calibrate(prefill, decode, 256, 0.5, 0.078125)
    assert (a, b, c) == (0.25, 0.5 / 512, 0.0) and (d, e) == (0.0390625, 0.0390625)
    ttft, tpot = tune.simulate([tune.serve.RequestSpec(256, 9)], 0.001, 1, 1, (a, b, c), (d, e))
    assert ttft == [0.5] and tpot == [0.078125]
    assert tune.calibrate(prefill, decode, 256, None, 0.0) == (prefill, decode)


def test_conditional_disaggregation_that_never_fires_is_the_plain_simulation():
    """With ``router.local_prefill_queue_s`` never exceeded, every prompt goes through the
    prefill pool, and the simulation is ``simulate``'s, request for request."""
    from bench.sim_conditional import simulate_conditional

    specs = [tune.serve.RequestSpec(64 + 37 * (i % 9), 5 + i % 13) for i in range(120)]
    fits = tune.fit(PROFILE)
    for rate in (0.5, 3.0):
        ttft, tpot, local = simulate_conditional(specs, rate, 1, 1, *fits, queue_s=float("inf"))
        assert local == 0 and (ttft, tpot) == tuple(tune.simulate(specs, rate, 1, 1, *fits))


def test_conditional_disaggregation_prefills_on_decode_while_the_pool_is_busy():
    """A queue at the prefill pool sends prompts to decode, one at a time (max_local 1): the
    TTFT tail shrinks against every prompt through prefill; when requests come far apart,
    few are prefilled locally (those that Poisson arrivals put within a prefill of another)."""
    from bench.sim_conditional import simulate_conditional

    specs = [tune.serve.RequestSpec(256, 20)] * 200
    fits = tune.fit(PROFILE)
    _, _, calm_local = simulate_conditional(specs, 0.05, 1, 1, *fits)
    always, _ = tune.simulate(specs, 2.0, 1, 1, *fits)
    ttft, tpot, local = simulate_conditional(specs, 2.0, 1, 1, *fits)
    assert calm_local < 0.05 * len(specs) < local < len(specs)
    assert sorted(ttft)[180] < sorted(always)[180] and all(t > 0 for t in tpot)
    always_g = tune.predicted_goodput(specs, 1, 1, *fits, ttft_slo=3.0, tpot_slo=0.3, target=0.9)
    cond_g = tune.predicted_goodput(specs, 1, 1, *fits, ttft_slo=3.0, tpot_slo=0.3, target=0.9, local_queue_s=0.05)
    assert cond_g > always_g


def test_compare_predicts_the_default_mode_with_conditional_disaggregation():
    """bench/run.sh compare's prediction for each system follows its config: the default
    disaggregated mode with decode prefilling when the pool queues, the one that sends every
    prompt through prefill without."""
    import types

    from bench import compare

    args = types.SimpleNamespace(seed=1, input_len=256, output_len=32, range_ratio=0.5, attainment=0.9)
    specs, profiles = compare.workload_specs(args, 150), {"1": PROFILE, "2": PROFILE}
    default = compare.predict("disaggregated", profiles, 2, specs, args, 3.0, 0.3, [0.5, 1.0, 2.0])
    always = compare.predict("disaggregated-always", profiles, 2, specs, args, 3.0, 0.3, [0.5, 1.0, 2.0])
    assert "decode prefilling" in default["model"] and "every prompt through prefill" in always["model"]
    assert default["goodput_rps"] > 0 and always["goodput_rps"] > 0 and default["goodput_rps"] != always["goodput_rps"]
