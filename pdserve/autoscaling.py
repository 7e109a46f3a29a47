"""Per-pool autoscaling: pdserve's custom policy for Ray Serve's autoscaler.

Each replica reports its load through Ray Serve's ``record_autoscaling_stats`` hook
(``replica_stats``); Ray Serve's controller averages the reports over
``look_back_period_s`` and calls ``PoolAutoscaler`` each control-loop tick with them.
Ray Serve then applies ``min_replicas``/``max_replicas`` and the ``upscale_delay_s`` /
``downscale_delay_s`` waits, so a decision must hold for that long before it acts.

Signals (the ``metric`` of a pool's ``autoscaling_policy`` in cluster.yaml):

- prefill ``queued_tokens``: prompt tokens waiting or being prefilled, summed over the
  pool; replicas = ceil(total / ``target_queued_tokens``).
- prefill ``ttft``: the p90 of recent prefill latencies (queue + compute, seconds) against
  ``ttft_slo_s``: one more replica above the SLO, one fewer under half of it.
- decode ``load``: running + waiting requests and KV block usage; replicas = the larger of
  ceil(requests / ``target_running``) and ceil(usage / ``target_kv_usage``).
- decode ``tpot``: the p90 of recent decode step times against ``tpot_slo_s``, as ``ttft``.

No flapping: besides Ray Serve's delays, a pool only shrinks when its load would still
fit the smaller pool at ``downscale_headroom`` of its target (hysteresis), and, for the
symptom signals (queue, latency), when its capacity use does too: prefill's busy time,
decode's requests and KV usage (``desired_replicas``).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

log = logging.getLogger("ray.serve")
POLICY_FUNCTION = "pdserve.autoscaling:PoolAutoscaler"
METRICS = {"prefill": ("queued_tokens", "ttft"), "decode": ("load", "tpot"), "colocated": ("load", "tpot")}


class PolicyConfigError(ValueError):
    """An ``autoscaling_policy`` key is unknown or out of range."""


@dataclass
class PolicySettings:
    """A pool's ``autoscaling_policy`` section (cluster.yaml); units in the field names."""

    metric: str = "queued_tokens"
    target_queued_tokens: float = 4096.0  # prompt tokens queued per prefill replica
    ttft_slo_s: float = 2.0
    target_running: float = 16.0  # running + waiting requests per decode replica
    target_kv_usage: float = 0.8  # fraction of KV blocks in use per decode replica
    tpot_slo_s: float = 0.2
    downscale_headroom: float = 0.7  # shrink only if the load fits at this fraction of the target
    report_hold_s: float = 30.0  # with no fresh report, keep the last decision this long (seconds)

    @classmethod
    def parse(cls, pool: str, raw: dict[str, Any]) -> "PolicySettings":
        """Raises PolicyConfigError naming the key for an unknown key or a bad value."""
        known = {f.name for f in dataclasses.fields(cls)}
        for key in raw:
            if key not in known:
                raise PolicyConfigError(f"{pool}.autoscaling_policy: unknown key {key!r}")
        settings = cls(**{"metric": METRICS[pool][0], **raw})
        if settings.metric not in METRICS[pool]:
            raise PolicyConfigError(f"{pool}.autoscaling_policy.metric must be one of {', '.join(METRICS[pool])}, not {settings.metric!r}")
        for key in known - {"metric"}:
            if not float(getattr(settings, key)) > 0:
                raise PolicyConfigError(f"{pool}.autoscaling_policy.{key} must be > 0")
        if not settings.downscale_headroom <= 1:
            raise PolicyConfigError(f"{pool}.autoscaling_policy.downscale_headroom must be in (0, 1]")
        return settings


def _fits(total: float, target: float, headroom: float) -> int:
    """Replicas needed to carry ``total`` at ``headroom`` x ``target`` each."""
    return math.ceil(total / (target * headroom))


_SIGNAL = {"queued_tokens": "num_uncomputed_tokens", "ttft": "ttft_p90_s", "load": "num_requests", "tpot": "tpot_p90_s"}  # metric -> report key


def num_reporting(settings: PolicySettings, metrics: dict[str, list[float]]) -> int:
    """Replicas with a fresh value of the signal ``settings.metric`` reads."""
    return len(metrics.get(_SIGNAL[settings.metric], []))


def desired_replicas(settings: PolicySettings, current: int, metrics: dict[str, list[float]]) -> int:
    """Replicas the pool wants now, given its current target size ``current``, before Ray
    Serve's bounds and delays.

    ``metrics``: metric name -> one value per running replica (their ``replica_stats``,
    averaged over the look-back window). With no report in the window the answer is
    ``current``: a replica too busy to report in time must not look idle.

    Queue length and latency are symptoms that fade once a pool is big enough, so a pool
    sized on them would shrink, queue again and grow (flapping). A shrink must therefore
    also pass a capacity check: prefill only if its busy time (``busy_fraction`` summed
    over replicas) fits the smaller pool at ``downscale_headroom``; decode only if its
    requests and KV usage do.
    """
    current = max(current, 1)
    if not num_reporting(settings, metrics):  # no fresh report in the window (a busy replica can be late): hold, never read it as idle
        return current
    total = {name: sum(values) for name, values in metrics.items()}
    headroom = settings.downscale_headroom
    if settings.metric in ("ttft", "tpot"):
        values = metrics.get(f"{settings.metric}_p90_s", [])
        if not values:
            return current
        slo = settings.ttft_slo_s if settings.metric == "ttft" else settings.tpot_slo_s
        worst = max(values)
        want = current + 1 if worst > slo else current - 1 if worst < slo * 0.5 else current
    elif settings.metric == "queued_tokens":
        want = math.ceil(total.get("num_uncomputed_tokens", 0.0) / settings.target_queued_tokens)
        if want < current:
            want = max(want, _fits(total.get("num_uncomputed_tokens", 0.0), settings.target_queued_tokens, headroom))
    else:  # load: requests and KV usage are capacity, not symptoms
        loads = [(total.get("num_requests", 0.0), settings.target_running), (total.get("kv_usage", 0.0), settings.target_kv_usage)]
        want = max(math.ceil(t / target) for t, target in loads)
        if want < current:
            want = max(want, *(_fits(t, target, headroom) for t, target in loads))
    if want < current:  # the capacity check
        if settings.metric in ("queued_tokens", "ttft"):
            want = max(want, _fits(total.get("busy_fraction", 0.0), 1.0, headroom))
        elif settings.metric == "tpot":
            want = max(want, _fits(total.get("num_requests", 0.0), settings.target_running, headroom),
                       _fits(total.get("kv_usage", 0.0), settings.target_kv_usage, headroom))
    return max(0, min(want, 2 * current))  # at most double per decision


class PoolAutoscaler:
    """Ray Serve custom autoscaling policy (a class policy: ``policy_kwargs`` are its
    constructor's arguments). Called with an ``AutoscalingContext`` each control-loop
    tick; returns (replicas wanted, policy state).

    A tick without a fresh report repeats the last decision (for up to
    ``report_hold_s``): a replica busy at 100% reports late, and answering "no change"
    for that tick would restart Ray Serve's ``upscale_delay_s`` wait, so a saturated pool
    whose reports arrive every other tick would never grow."""

    def __init__(self, pool: str, **settings: Any):
        self.pool = pool
        self.settings = PolicySettings.parse(pool, settings)
        # seconds, monotonic; an attribute, not the module's ``time``: Ray may cloudpickle this
        # class by value, and the methods it puts back read a copy of the module's globals
        self.clock = time.monotonic

    def __call__(self, ctx) -> tuple[int, dict[str, Any]]:
        per_replica = ctx.aggregated_metrics or {}
        metrics = {name: list(values.values()) for name, values in per_replica.items()}
        state, now = dict(ctx.policy_state or {}), self.clock()
        last_wanted = state.get("pdserve_last_wanted", ctx.target_num_replicas)
        if num_reporting(self.settings, metrics):
            # sized against the target (replicas starting count), so a pool does not shrink while it grows
            want = desired_replicas(self.settings, ctx.target_num_replicas, metrics)
            state["pdserve_reported_at"] = now
            if num_reporting(self.settings, metrics) < ctx.current_num_replicas:  # the silent ones may be the busy ones
                want = max(want, ctx.target_num_replicas)  # partial reports can grow the pool, never shrink it
        elif now - state.get("pdserve_reported_at", -math.inf) <= self.settings.report_hold_s:
            want = last_wanted  # a late report is not a change of mind
        else:
            want = ctx.target_num_replicas
        if want != last_wanted:  # in the Serve controller's log
            log.info("pdserve %s pool wants %d replicas (target %d, %d running) on %s: %s", self.pool, want, ctx.target_num_replicas,
                     ctx.current_num_replicas, self.settings.metric, {k: round(sum(v), 3) for k, v in metrics.items()})
        state["pdserve_last_wanted"] = want
        return want, state


def ray_policy(pool: str, raw: dict[str, Any] | None) -> dict[str, Any] | None:
    """The ``policy`` entry of a pool's Ray Serve autoscaling config; None = Ray's default."""
    if raw is None:
        return None
    PolicySettings.parse(pool, raw)  # fail at deploy, not in the controller
    return {"policy_function": POLICY_FUNCTION, "policy_kwargs": {"pool": pool, **raw}}


class LatencyWindow:
    """Recent latencies (seconds) of one replica, for the ``ttft``/``tpot`` signals. Thread-safe."""

    def __init__(self, window_s: float = 10.0, max_samples: int = 4096, clock: Callable[[], float] = time.monotonic):
        self.clock = clock  # seconds, monotonic
        self.window_s = window_s
        self._samples: collections.deque[tuple[float, float]] = collections.deque(maxlen=max_samples)
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        with self._lock:
            self._samples.append((self.clock(), seconds))

    def p90(self) -> float:
        """p90 over the last ``window_s`` seconds; 0.0 with no samples."""
        since = self.clock() - self.window_s
        with self._lock:
            values = sorted(v for t, v in self._samples if t >= since)
        return values[min(len(values) - 1, int(0.9 * len(values)))] if values else 0.0


class BusyMeter:
    """Fraction of wall time the engine spent in forward passes since the previous reading."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock  # seconds, monotonic
        self._last: tuple[float, float] | None = None  # (monotonic time, cumulative busy seconds)

    def fraction(self, busy_s: float) -> float:
        now = self.clock()
        last, self._last = self._last, (now, busy_s)
        if last is None or now <= last[0]:
            return 0.0
        return min(1.0, max(0.0, (busy_s - last[1]) / (now - last[0])))


def replica_stats(stats: dict[str, float], latencies: LatencyWindow, latency_name: str, busy: BusyMeter) -> dict[str, float]:
    """What a replica reports to Ray Serve's autoscaler, from its engine ``stats()``."""
    return {
        "num_uncomputed_tokens": float(stats.get("num_uncomputed_tokens", 0)),
        "num_requests": float(stats.get("num_running", 0) + stats.get("num_waiting", 0)),
        "kv_usage": stats.get("num_used_blocks", 0) / max(1, stats.get("num_blocks", 1)),
        "busy_fraction": busy.fraction(stats.get("busy_s", 0.0)),
        f"{latency_name}_p90_s": latencies.p90(),
    }
