"""Prometheus metrics through Ray's metrics API (``ray.util.metrics``), exported by each Ray
node's metrics agent at ``http://<node>:<metrics_export_port>/metrics``.

Names follow vLLM's (https://docs.vllm.ai/en/latest/design/metrics.html) with a ``pdserve_``
prefix; Ray's exporter adds ``ray_`` in front, e.g. ``ray_pdserve_time_to_first_token_seconds``.
(vLLM's own separator is ``:``, as in ``vllm:time_to_first_token_seconds``, but Ray 2.60
deprecates ``:`` in metric names and its OpenTelemetry exporter drops such metrics.)

- router: TTFT, inter-token latency and end-to-end latency histograms (seconds); prompt
  and generation token counters; finished requests by ``finished_reason``.
- both pools (tags ``pool`` and ``replica``, one series per replica): running and waiting
  requests, KV usage (0-1) and blocks used and in all, KV leases held. A pool's usage is
  ``sum(pdserve_kv_blocks_used) / sum(pdserve_kv_blocks_total)`` over its replicas.
- decode pool: KV transfer bytes and seconds (tag ``transport``), and faults.

Every object is a no-op outside a Ray worker, so the engine and tests run without Ray.
"""

from __future__ import annotations

import threading
from typing import Callable

TTFT_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
ITL_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]
E2E_BUCKETS = [0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0]
TRANSFER_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0]


class _Null:
    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def _metrics():
    try:
        import ray
        from ray.util import metrics

        return metrics if ray.is_initialized() else None
    except ImportError:
        return None


class RouterMetrics:
    def __init__(self, model: str):
        m = _metrics()
        if m is None:
            self.ttft = self.itl = self.e2e = self.prompt_tokens = self.generation_tokens = self.finished = self.placement = _Null()
            return
        tags = {"model_name": model}

        def histogram(name, description, buckets):
            h = m.Histogram(name, description=description, boundaries=buckets, tag_keys=("model_name",))
            h.set_default_tags(tags)
            return h

        def counter(name, description, keys=("model_name",)):
            c = m.Counter(name, description=description, tag_keys=keys)
            c.set_default_tags(tags)
            return c

        self.ttft = histogram("pdserve_time_to_first_token_seconds", "Seconds from request to its first token, at the router", TTFT_BUCKETS)
        self.itl = histogram("pdserve_inter_token_latency_seconds", "Seconds between consecutive output tokens", ITL_BUCKETS)
        self.e2e = histogram("pdserve_e2e_request_latency_seconds", "Seconds from request to its last token", E2E_BUCKETS)
        self.prompt_tokens = counter("pdserve_prompt_tokens_total", "Prompt tokens of requests that reached prefill")
        self.generation_tokens = counter("pdserve_generation_tokens_total", "Output tokens streamed to clients")
        self.finished = counter("pdserve_request_success_total", "Finished requests by finished_reason (stop, length, abort)",
                                ("model_name", "finished_reason"))
        self.placement = counter("pdserve_prefill_placement_total", "Prefills by where they ran: remote (the prefill pool), "
                                 "local_short / local_queued (the decode replica: a short prompt / a long prefill queue)", ("model_name", "where"))


class PoolMetrics:
    """Gauges of one worker, refreshed from ``stats()`` every ``interval_s`` by a daemon thread."""

    def __init__(self, pool: str, model: str, stats: Callable[[], dict], interval_s: float = 1.0, replica: str = ""):
        m = _metrics()
        self.kv_transfer_bytes = self.kv_transfer_seconds = self.kv_transfer_faults = _Null()
        if m is None:
            return
        tags = {"pool": pool, "model_name": model}

        def gauge(name, description):  # one series per replica (tag ``replica``): sum or average them per pool
            g = m.Gauge(name, description=description, tag_keys=("pool", "model_name", "replica"))
            g.set_default_tags({**tags, "replica": replica})
            return g

        self._gauges = {
            "num_running": gauge("pdserve_num_requests_running", "Sequences in the running batch"),
            "num_waiting": gauge("pdserve_num_requests_waiting", "Sequences queued for the engine"),
            "kv_usage": gauge("pdserve_kv_cache_usage_perc", "Fraction of this replica's KV blocks in use (0-1)"),
            "kv_used": gauge("pdserve_kv_blocks_used", "KV blocks in use; a pool's usage is sum(used) / sum(total)"),
            "kv_total": gauge("pdserve_kv_blocks_total", "KV blocks in this replica's pool"),
            "num_held": gauge("pdserve_kv_leases_held", "Prompt KVs held for decode to fetch (prefill)"),
        }
        keys = ("pool", "model_name", "transport")
        self.kv_transfer_bytes = m.Counter("pdserve_kv_transfer_bytes_total", description="KV bytes received", tag_keys=keys)
        self.kv_transfer_seconds = m.Histogram("pdserve_kv_transfer_seconds", description="Seconds per KV fetch, acknowledgement included",
                                               boundaries=TRANSFER_BUCKETS, tag_keys=keys)
        self.kv_transfer_faults = m.Counter("pdserve_kv_transfer_faults_total", description="KV fetches that failed", tag_keys=("pool", "model_name"))
        for metric in (self.kv_transfer_bytes, self.kv_transfer_seconds, self.kv_transfer_faults):
            metric.set_default_tags(tags)
        self._stats = stats
        self._stop = threading.Event()
        threading.Thread(target=self._loop, args=(interval_s,), daemon=True, name="pdserve-metrics").start()

    def _loop(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                s = self._stats()
                self._gauges["num_running"].set(s.get("num_running", 0))
                self._gauges["num_waiting"].set(s.get("num_waiting", 0))
                self._gauges["kv_usage"].set(s.get("num_used_blocks", 0) / max(1, s.get("num_blocks", 1)))
                self._gauges["kv_used"].set(s.get("num_used_blocks", 0))
                self._gauges["kv_total"].set(s.get("num_blocks", 0))
                self._gauges["num_held"].set(s.get("num_held", 0))
            except Exception:  # noqa: BLE001 - metrics never take a worker down
                pass

    def close(self) -> None:
        if hasattr(self, "_stop"):
            self._stop.set()
