"""The soak's report (bench/soak.py): which replicas the RSS target counts, and the totals."""

import pytest

from bench.soak import rss_growth, summarize

MIB = 1 << 20


def phase(backend: str = "shm") -> dict:
    # prefill#a was killed mid-load (no end sample); prefill#c replaced it and was still warming up.
    return {
        "backend": backend, "requests_total": 10, "requests_lost": 0, "wrong_outputs": 0, "cancels_left_running": 0,
        "explicit_errors": {"HTTP 429": 2}, "blocks_leaked": {"prefill#b": 0, "decode#x": 0}, "leases_leaked": {"prefill#b": 0},
        "kv_faults_taken": ["break"],
        "replicas_at_load_start": ["decode#x", "prefill#a", "prefill#b"],
        "rss_start_bytes": {"prefill#b": 400 * MIB, "prefill#c": 300 * MIB, "decode#x": 500 * MIB},
        "rss_end_bytes": {"prefill#b": 404 * MIB, "prefill#c": 390 * MIB, "decode#x": 505 * MIB},
    }


def test_rss_target_counts_only_replicas_that_served_the_whole_load():
    assert rss_growth(phase()) == pytest.approx(0.01)
    assert rss_growth(phase(), replacements=True) == pytest.approx(0.3)


def test_a_replica_without_both_samples_is_left_out():
    p = phase()
    p["rss_end_bytes"] = {}
    assert rss_growth(p) is None and rss_growth(p, replacements=True) is None


def test_summary_adds_phases_and_keeps_the_worst_growth():
    second = phase("grpc")
    second["rss_end_bytes"]["decode#x"] = 510 * MIB
    second["events"] = ["48s killed SERVE_REPLICA::pdserve#prefill#a1", "156s killed SERVE_REPLICA::pdserve#router#b2", "72s armed KV fault timeout"]
    s = summarize([phase(), second])
    assert s["replica_kills"] == {"prefill": 1, "router": 1} and s["router_kills"] == 1
    assert s["requests_total"] == 20 and s["explicit_errors"] == {"HTTP 429": 4}
    assert s["rss_growth_max"] == 0.02 and s["rss_growth_max_replacements"] == 0.3
    assert s["kv_faults_injected"] == {"shm": ["break"], "grpc": ["break"]}
