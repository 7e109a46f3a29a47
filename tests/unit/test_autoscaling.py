"""pdserve's autoscaling policy on fabricated replica reports (no Ray): each signal's
arithmetic, the hysteresis that keeps a pool from flapping, and the config checks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pdserve.autoscaling import BusyMeter, LatencyWindow, PolicyConfigError, PolicySettings, PoolAutoscaler, desired_replicas, ray_policy, replica_stats


def settings(pool: str, **raw) -> PolicySettings:
    return PolicySettings.parse(pool, raw)


@pytest.fixture
def clock() -> SimpleNamespace:
    """A fake clock for the classes' ``clock``: set ``clock.now`` to move it. (Not a patch of
    the module's ``time``: after the cluster tests, Ray has cloudpickled PoolAutoscaler in
    this process, and its methods read a copy of the module's globals.)"""
    clock = SimpleNamespace(now=1000.0)
    clock.read = lambda: clock.now
    return clock


@pytest.mark.parametrize("queued, current, want", [
    ([0.0], 1, 0), ([4096.0], 1, 1), ([4097.0], 1, 2), ([9000.0, 9000.0], 2, 4), ([20000.0], 1, 2),  # at most double; 0 = Ray applies min_replicas
    ([3000.0, 0.0], 2, 2),  # 3000 fits one replica, but not at 70% headroom (2867): stay at 2
    ([2000.0, 0.0], 2, 1),
])
def test_prefill_scales_on_queued_prompt_tokens(queued, current, want):
    assert desired_replicas(settings("prefill"), current, {"num_uncomputed_tokens": queued}) == want


@pytest.mark.parametrize("pool, metric, signal", [
    ("prefill", "queued_tokens", {"num_uncomputed_tokens": [0.0, 0.0]}),
    ("prefill", "ttft", {"ttft_p90_s": [0.1, 0.1]}),
])
def test_prefill_does_not_shrink_while_its_replicas_are_busy(pool, metric, signal):
    """The queue (or TTFT) is gone because two replicas keep up: one alone would not."""
    s = settings(pool, metric=metric)
    assert desired_replicas(s, 2, {**signal, "busy_fraction": [0.5, 0.4]}) == 2
    assert desired_replicas(s, 2, {**signal, "busy_fraction": [0.3, 0.2]}) == 1


def test_decode_on_tpot_does_not_shrink_while_its_requests_need_two_replicas():
    s = settings("decode", metric="tpot", tpot_slo_s=1.0)
    assert desired_replicas(s, 2, {"tpot_p90_s": [0.1, 0.1], "num_requests": [8.0, 8.0], "kv_usage": [0.1, 0.1]}) == 2
    assert desired_replicas(s, 2, {"tpot_p90_s": [0.1, 0.1], "num_requests": [3.0, 2.0], "kv_usage": [0.1, 0.1]}) == 1


@pytest.mark.parametrize("requests, usage, current, want", [
    ([4.0], [0.1], 1, 1), ([17.0], [0.1], 1, 2), ([4.0], [0.9], 1, 2),  # KV usage alone scales up
    ([20.0, 10.0], [0.5, 0.3], 2, 2), ([8.0, 2.0], [0.2, 0.1], 2, 1), ([12.0, 0.0], [0.1, 0.0], 2, 2),  # 12 > 16 * 0.7
])
def test_decode_scales_on_running_requests_and_kv_usage(requests, usage, current, want):
    assert desired_replicas(settings("decode"), current, {"num_requests": requests, "kv_usage": usage}) == want


@pytest.mark.parametrize("pool, metric, slo_key", [("prefill", "ttft", "ttft_slo_s"), ("decode", "tpot", "tpot_slo_s")])
def test_latency_signals_step_one_replica_against_the_slo(pool, metric, slo_key):
    s = settings(pool, metric=metric, **{slo_key: 1.0})
    key = f"{metric}_p90_s"
    assert desired_replicas(s, 2, {key: [0.3, 1.2]}) == 3  # the worst replica misses the SLO
    assert desired_replicas(s, 2, {key: [0.6, 0.9]}) == 2  # within the SLO, above half of it: stay
    assert desired_replicas(s, 2, {key: [0.1, 0.4]}) == 1  # (idle: nothing busy, nothing running)
    assert desired_replicas(s, 1, {key: [0.0]}) == 0  # idle: Ray Serve applies min_replicas
    assert desired_replicas(s, 3, {}) == 3  # no reports yet: no change


@pytest.mark.parametrize("pool", ["prefill", "decode"])
def test_a_window_without_reports_holds_the_size(pool):
    """Ray Serve passes no metrics when no report is fresh (a busy replica reports late):
    that must not read as an idle pool."""
    assert desired_replicas(settings(pool), 2, {}) == 2


def test_a_load_between_the_thresholds_holds_the_size_either_way():
    """Hysteresis: one load, two pool sizes, each stays where it is."""
    s = settings("decode")
    load = {"num_requests": [14.0], "kv_usage": [0.1]}  # fits 1 replica (16), not at headroom (11.2)
    assert desired_replicas(s, 1, load) == 1 and desired_replicas(s, 2, load) == 2


def test_the_ray_policy_wraps_the_context():
    policy = PoolAutoscaler("decode", target_running=4)
    ctx = SimpleNamespace(current_num_replicas=1, target_num_replicas=1, policy_state={"x": 1},
                          aggregated_metrics={"num_requests": {"r1": 9.0}, "kv_usage": {"r1": 0.2}})
    want, state = policy(ctx)
    assert want == 2 and state["x"] == 1 and state["pdserve_last_wanted"] == 2
    assert ray_policy("prefill", {}) == {"policy_function": "pdserve.autoscaling:PoolAutoscaler", "policy_kwargs": {"pool": "prefill"}}


def test_a_tick_without_a_report_repeats_the_last_decision_for_a_while(clock):
    """A saturated replica reports every other tick; answering "no change" on the silent
    ticks would restart Ray Serve's upscale delay and the pool would never grow."""
    policy = PoolAutoscaler("prefill", target_queued_tokens=512, report_hold_s=0.25)
    policy.clock = clock.read
    busy = {"num_uncomputed_tokens": {"r1": 3000.0}, "busy_fraction": {"r1": 1.0}}
    state = None
    # silent ticks 0.125 s and exactly report_hold_s after the last report still hold the decision
    for at, metrics in ((1000.0, busy), (1000.125, {}), (1000.25, busy), (1000.5, {})):
        clock.now = at
        want, state = policy(SimpleNamespace(current_num_replicas=1, target_num_replicas=1, policy_state=state, aggregated_metrics=metrics))
        assert want == 2, (at, state)
    clock.now = 1000.625  # silent for longer than report_hold_s: back to "no change"
    want, state = policy(SimpleNamespace(current_num_replicas=1, target_num_replicas=1, policy_state=state, aggregated_metrics={}))
    assert want == 1, (state, policy.settings, PoolAutoscaler.__call__.__globals__["time"])


def test_a_tick_where_only_an_idle_replica_reported_does_not_shrink_the_pool():
    policy = PoolAutoscaler("prefill", target_queued_tokens=512)
    idle_only = {"num_uncomputed_tokens": {"r2": 0.0}, "busy_fraction": {"r2": 0.0}}
    ctx = SimpleNamespace(current_num_replicas=2, target_num_replicas=2, policy_state=None, aggregated_metrics=idle_only)
    assert policy(ctx)[0] == 2
    ctx.aggregated_metrics = {"num_uncomputed_tokens": {"r1": 3000.0}, "busy_fraction": {"r1": 1.0}}
    assert policy(ctx)[0] == 4  # ... but may grow it
    ctx.aggregated_metrics = {"num_uncomputed_tokens": {"r1": 0.0, "r2": 0.0}, "busy_fraction": {"r1": 0.0, "r2": 0.0}}
    assert policy(ctx)[0] == 0  # all reported, all idle (Ray Serve applies min_replicas)


@pytest.mark.parametrize("pool, raw, message", [
    ("prefill", {"metric": "load"}, "metric must be one of queued_tokens, ttft"),
    ("decode", {"ttft_slo": 1}, "unknown key 'ttft_slo'"),
    ("decode", {"tpot_slo_s": -1}, "tpot_slo_s must be > 0"),
    ("prefill", {"downscale_headroom": 1.5}, "downscale_headroom must be in"),
])
def test_bad_settings_name_the_key(pool, raw, message):
    with pytest.raises(PolicyConfigError, match=message):
        PolicySettings.parse(pool, raw)


def test_replica_stats_from_engine_stats():
    window = LatencyWindow()
    for v in [0.1] * 9 + [5.0]:
        window.observe(v)
    stats = {"num_uncomputed_tokens": 700, "num_running": 3, "num_waiting": 2, "num_used_blocks": 25, "num_blocks": 100, "busy_s": 1.0}
    assert replica_stats(stats, window, "ttft", BusyMeter()) == {
        "num_uncomputed_tokens": 700.0, "num_requests": 5.0, "kv_usage": 0.25, "busy_fraction": 0.0, "ttft_p90_s": 5.0}


def test_busy_meter_reads_the_busy_share_of_the_time_between_readings(clock):
    meter = BusyMeter(clock.read)
    assert meter.fraction(10.0) == 0.0  # first reading: no interval yet
    clock.now += 0.5
    assert meter.fraction(10.125) == 0.25  # 0.125 busy seconds of 0.5
    assert meter.fraction(10.125) == 0.0  # no time passed since: no interval
    clock.now += 0.5
    assert meter.fraction(10.125) == 0.0  # idle for 0.5 s
    clock.now += 0.25
    assert meter.fraction(11.125) == 1.0  # a step's busy seconds counted late: capped at all of it
    assert LatencyWindow().p90() == 0.0
