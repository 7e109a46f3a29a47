"""Soak and fault run: ``bash bench/run.sh soak`` (or ``python -m bench.soak``).

On a local Ray cluster (2 CPUs) it deploys 2 prefill + 2 decode replicas once per KV
backend this node offers (``shm``, then ``grpc``), and in each phase:

1. measures capacity: completed requests/s of a closed loop of ``--concurrency`` clients
   sending the soak's requests without cancels;
2. sends requests at ``--load`` x that rate (Poisson arrivals, open loop) for the phase's
   share of ``--minutes``: gRPC and HTTP, streamed or not, greedy, checked against reference
   answers or their length, a share cancelled at every stage (bench/soak_load.py);
3. meanwhile kills one prefill replica (at 20% of the phase), one decode replica (at 45%)
   and the router replica (at 65%: the pools must stop its requests, pdserve/callers.py;
   its clients get an error), and arms each KV fault of ``kv_transfer/faults.py`` once (timeout, break, corrupt,
   expire at 30-85%) in the prefill replicas, through ``PDSERVE_FAULT_KV_DIR``;
4. samples every 2 s whether a request runs on after its client left (below);
5. when the last client is done, waits 5 s and checks every replica: requests running or
   waiting, leases held, blocks in use, the router's requests in flight; and each replica's
   RSS against its RSS 60% into the load (after the kills and the peak load they shift onto
   the survivors: the C heap keeps its peak, so later growth is what a leak adds). The RSS
   target counts the replicas that served the whole load; the replacements of the killed
   ones, started mid-load and still warming up, are reported apart.

The reference answers are each reference prompt's answer served alone on the idle cluster
before any load; the engine is batch invariant (docs/numerics.md), so under load, faults,
chunking, migration and recompute the same prompt must give the same tokens.

``cancels_left_running``: the most requests seen running after their client left more than
5 s before, over the samples: the router's requests in flight beyond the clients' open calls,
or the decode pool's running requests beyond the router's, each less the calls that ended
in the last 5 s (those may still be finishing). Writes ``reliability.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import time
from collections import Counter, deque
from pathlib import Path

from bench.hardware import describe
from bench.soak_load import Caller, Outcome, Spec, draw

ROOT = Path(__file__).resolve().parents[1]
GRPC_PORT, HTTP_PORT = 9400, 8400
FAULTS = (("timeout", 0.30), ("break", 0.55), ("corrupt", 0.70), ("expire", 0.85))
KILLS = (("prefill", 0.20), ("decode", 0.45), ("router", 0.65))
SETTLE_S, SAMPLE_S = 5.0, 2.0
RSS_WARMUP = 0.6  # RSS "at the start" is taken this far into the load: after both kills and the load they shift


def cluster_config(backend: str, fault_dir: str, grpc_port: int = GRPC_PORT, http_port: int = HTTP_PORT) -> dict:
    """2 prefill + 2 decode replicas on ``backend``; prefill replicas armed from ``fault_dir``.
    A KV fetch times out after 4 s, so an injected 5 s stall is a fault. The router refuses
    what would queue past 10 s (``router.max_queue_s``)."""
    pool = {"autoscaling_config": {"min_replicas": 2, "max_replicas": 2}, "ray_actor_options": {"num_cpus": 0.5}, "kv_cache_tokens": 8192}
    env = {"runtime_env": {"env_vars": {"PDSERVE_FAULT_KV_DIR": fault_dir}}}
    return {"model": {"max_model_len": 1024}, "router": {"grpc_port": grpc_port, "http_port": http_port, "retry_backoff_s": 0.2, "max_queue_s": 10.0},
            "prefill": {**pool, "ray_actor_options": {"num_cpus": 0.5, **env}}, "decode": pool,
            "kv_transfer": {"backend": backend, "timeout_s": 4.0}}


def replica_stats(pool: str, want: int = 2, tries: int = 40) -> dict[str, dict]:
    """Stats of every running replica of ``pool`` (a call reaches any one: ask until ``want`` answered)."""
    from ray import serve

    handle, seen = serve.get_deployment_handle(pool, "pdserve"), {}
    for _ in range(tries):
        s = handle.stats.remote().result(timeout_s=30)
        seen[s["replica"]] = s
        if len(seen) >= want:
            break
    return seen


def kill_one(pool: str) -> str:
    import ray

    names = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                   if a["name"].startswith(f"SERVE_REPLICA::pdserve#{pool}#"))
    ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
    return names[0]


async def references(caller: Caller, rng: random.Random, num: int) -> list[tuple[list[int], int, list[int], str]]:
    """``num`` reference prompts, each answered alone: (prompt ids, max_tokens, answer ids, answer text)."""
    out = []
    for _ in range(num):
        prompt, max_tokens = [rng.randrange(1000, 30000) for _ in range(rng.randint(30, 150))], rng.randint(16, 48)
        result = await caller.grpc.generate(prompt_token_ids=prompt, max_tokens=max_tokens, ignore_eos=True, timeout_s=caller.deadline_s)
        out.append((prompt, max_tokens, result.token_ids, result.text))
    return out


class Tally:
    """Outcomes, open calls and the recent ends the leftover sampling needs."""

    def __init__(self):
        self.outcomes: list[tuple[Spec, Outcome]] = []
        self.open = 0
        self.ends: deque[float] = deque()

    async def run(self, caller: Caller, spec: Spec, rng: random.Random) -> None:
        self.open += 1
        try:
            self.outcomes.append((spec, await caller.call(spec, rng)))
        finally:
            self.open -= 1
            self.ends.append(time.monotonic())

    def recent_ends(self) -> int:
        while self.ends and self.ends[0] < time.monotonic() - SETTLE_S:
            self.ends.popleft()
        return len(self.ends)


async def capacity(caller: Caller, refs, rng: random.Random, concurrency: int, seconds: float) -> float:
    """Completed requests/s of a closed loop of ``concurrency`` clients, no cancels."""
    tally, stop = Tally(), time.monotonic() + seconds

    async def client(seed: int):
        r = random.Random(seed)
        while time.monotonic() < stop:
            await tally.run(caller, draw(r, refs, 0.0), r)

    start = time.monotonic()
    await asyncio.gather(*(client(rng.randrange(1 << 30)) for _ in range(concurrency)))
    return sum(o.kind == "ok" for _, o in tally.outcomes) / (time.monotonic() - start)


async def sample_leftovers(tally: Tally, stop: asyncio.Event) -> int:
    """The most requests seen running after their client left (the module doc)."""
    from ray import serve

    router, worst = serve.get_deployment_handle("router", "pdserve"), 0
    while not stop.is_set():
        try:
            decode = sum(s["num_running"] + s["num_waiting"] for s in (await asyncio.to_thread(replica_stats, "decode")).values())
            in_flight = (await asyncio.to_thread(lambda: router.stats.remote().result(timeout_s=30)))["num_in_flight"]
        except Exception:  # noqa: BLE001 - a replica being killed: skip this sample
            await asyncio.sleep(SAMPLE_S)
            continue
        slack = tally.open + tally.recent_ends()
        worst = max(worst, in_flight - slack, decode - in_flight - tally.recent_ends())
        await asyncio.sleep(SAMPLE_S)
    return worst


async def faults(fault_dir: str, seconds: float, start: float, log: list[str], kills=KILLS) -> None:
    """Kill a replica of each deployment in ``kills`` and arm each KV fault at their share of the phase."""
    plan = sorted([(at, "kill", pool) for pool, at in kills] + [(at, "arm", kind) for kind, at in FAULTS])
    for at, action, what in plan:
        await asyncio.sleep(max(0.0, start + at * seconds - time.monotonic()))
        if action == "kill":
            log.append(f"{time.monotonic() - start:.0f}s killed {await asyncio.to_thread(kill_one, what)}")
        else:
            Path(fault_dir, what).touch()
            log.append(f"{time.monotonic() - start:.0f}s armed KV fault {what}")


async def rss_after(when: float) -> dict[str, int]:
    """Each replica's RSS at monotonic time ``when``. The C heap keeps its peak
    (pdserve/engine/allocator.py), so growth after the load's peaks is what a leak adds."""
    await asyncio.sleep(max(0.0, when - time.monotonic()))
    return (await asyncio.to_thread(final_state))["rss_bytes"]


def final_state() -> dict:
    """Per replica: what it still holds. Also the router's requests in flight."""
    from ray import serve

    prefill, decode = replica_stats("prefill"), replica_stats("decode")
    return {
        "running": sum(s["num_running"] + s["num_waiting"] for s in (*prefill.values(), *decode.values())),
        "blocks_leaked": {r: s["num_blocks"] - s["num_free_blocks"] for r, s in (*prefill.items(), *decode.items())},
        "leases_leaked": {r: s["num_held"] for r, s in prefill.items()},
        "rss_bytes": {r: s["rss_bytes"] for r, s in (*prefill.items(), *decode.items())},
        "router_in_flight": serve.get_deployment_handle("router", "pdserve").stats.remote().result(timeout_s=30)["num_in_flight"],
    }


async def run_phase(backend: str, fault_dir: str, seconds: float, load: float, refs: list | None, seed: int,
                    concurrency: int = 6, capacity_s: float = 60.0, cancel_share: float = 0.2,
                    deadline_s: float = 120.0, ports: tuple[int, int] = (GRPC_PORT, HTTP_PORT), kills=KILLS) -> tuple[dict, list]:
    """One phase on the deployed cluster (see the module doc). ``refs``: the reference
    prompts and answers; None: made here first. Returns (the phase's report, the refs)."""
    import aiohttp

    from bench.serve import served_model
    from pdserve.client import AsyncClient

    rng, base_url = random.Random(seed), f"http://127.0.0.1:{ports[1]}/v1"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as http:
        caller = Caller(AsyncClient(f"127.0.0.1:{ports[0]}", retries=0), http, base_url, served_model(base_url), deadline_s)
        refs = refs if refs is not None else await references(caller, rng, 12)
        rate = load * await capacity(caller, refs, rng, concurrency, capacity_s)
        tally, stop, log, tasks = Tally(), asyncio.Event(), [], []
        sampler = asyncio.ensure_future(sample_leftovers(tally, stop))
        at_start = sorted((await asyncio.to_thread(final_state))["rss_bytes"])
        start = time.monotonic()
        injector = asyncio.ensure_future(faults(fault_dir, seconds, start, log, kills))
        rss_start = asyncio.ensure_future(rss_after(start + RSS_WARMUP * seconds))
        while time.monotonic() < start + seconds:
            tasks.append(asyncio.ensure_future(tally.run(caller, draw(rng, refs, cancel_share), random.Random(rng.random()))))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks, injector)
        rss_start = rss_start.result()
        await asyncio.sleep(SETTLE_S)
        stop.set()
        leftover = await sampler
        end = await asyncio.to_thread(final_state)
        await caller.grpc.close()
    armed = sorted(p.name for p in Path(fault_dir).iterdir())
    outcomes = [o for _, o in tally.outcomes]
    kinds = Counter(o.kind for o in outcomes)
    ok = [o for o in outcomes if o.kind == "ok"]
    p99 = lambda xs: round(statistics.quantiles(xs, n=100)[98], 4) if len(xs) >= 2 else None  # noqa: E731
    return {
        "backend": backend, "seconds": round(seconds), "capacity_rps": round(rate / load, 3), "rate_rps": round(rate, 3),
        "requests_total": len(outcomes), "completed": kinds["ok"], "cancelled": kinds["cancelled"],
        "requests_lost": kinds["lost"], "wrong_outputs": kinds["wrong"],
        "explicit_errors": {k.split(":", 1)[1]: n for k, n in kinds.items() if k.startswith("error:")},
        "cancels_left_running": max(0, leftover, end["running"]),
        "blocks_leaked": end["blocks_leaked"], "leases_leaked": end["leases_leaked"], "router_in_flight": end["router_in_flight"],
        "replicas_at_load_start": at_start, "rss_start_bytes": rss_start, "rss_end_bytes": end["rss_bytes"],
        "kv_faults_taken": sorted(name.split(".")[0] for name in armed if ".taken-" in name),
        "kv_faults_not_taken": sorted(name for name in armed if ".taken-" not in name),
        "ttft_p99_s": p99([o.ttft_s for o in ok if o.ttft_s is not None]), "tpot_p99_s": p99([o.tpot_s for o in ok if o.tpot_s is not None]),
        "events": log,
        "examples": {k: next(o.detail for o in outcomes if o.kind == k) for k in kinds if k not in ("ok", "cancelled")},
    }, refs


def rss_growth(phase: dict, replacements: bool = False) -> float | None:
    """The largest relative RSS growth, from the end of the load's warm-up (``RSS_WARMUP``)
    to the end of the phase, of a replica that served the whole load (``replacements``
    False); or of one that replaced a killed replica during it (True: it was still warming
    up its caches and C heap at the first sample, so its growth is reported, not a target)."""
    first = set(phase["replicas_at_load_start"])
    both = [r for r in phase["rss_start_bytes"] if r in phase["rss_end_bytes"] and (r not in first) == replacements]
    return max((phase["rss_end_bytes"][r] / phase["rss_start_bytes"][r] - 1 for r in both), default=None)


def summarize(phases: list[dict]) -> dict:
    total = lambda key: sum(p[key] for p in phases)  # noqa: E731
    errors: Counter = Counter()
    for p in phases:
        errors.update(p["explicit_errors"])
    kills = sum((Counter(e.split("#")[1] for e in p.get("events", ()) if " killed " in e) for p in phases), Counter())  # "12s killed SERVE_REPLICA::pdserve#router#id"
    growth = [g for g in map(rss_growth, phases) if g is not None]
    late = [g for g in (rss_growth(p, replacements=True) for p in phases) if g is not None]
    return {
        "requests_total": total("requests_total"), "requests_lost": total("requests_lost"), "wrong_outputs": total("wrong_outputs"),
        "explicit_errors": dict(errors), "cancels_left_running": max(p["cancels_left_running"] for p in phases),
        "blocks_leaked": sum(sum(p["blocks_leaked"].values()) for p in phases),
        "leases_leaked": sum(sum(p["leases_leaked"].values()) for p in phases),
        "rss_growth_max": round(max(growth), 4) if growth else None,
        "rss_growth_max_replacements": round(max(late), 4) if late else None,
        "kv_faults_injected": {p["backend"]: p["kv_faults_taken"] for p in phases},
        "replica_kills": dict(kills), "router_kills": kills["router"],
    }


def main(argv: list[str] | None = None) -> dict:
    import ray
    from ray import serve

    from pdserve.config import ClusterConfig
    from pdserve_app.deploy import deploy

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=16.0, help="load time over all phases (capacity runs and set-up extra)")
    parser.add_argument("--load", type=float, default=1.5, help="arrival rate as a multiple of the measured capacity")
    parser.add_argument("--backends", nargs="+", default=["shm", "grpc"])
    parser.add_argument("--concurrency", type=int, default=16, help="clients of the closed loop that measures capacity")
    parser.add_argument("--capacity-s", type=float, default=60.0, help="seconds of that closed loop, per phase")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    args = parser.parse_args(argv)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    phases, refs = [], None
    try:
        for i, backend in enumerate(args.backends):
            with tempfile.TemporaryDirectory(prefix="pdserve-soak-faults-") as fault_dir:
                deploy(ClusterConfig.from_dict(cluster_config(backend, fault_dir)))
                phase, refs = asyncio.run(run_phase(backend, fault_dir, args.minutes * 60 / len(args.backends), args.load, refs,
                                                    args.seed + i, args.concurrency, args.capacity_s))
                phases.append(phase)
                print(json.dumps({k: v for k, v in phase.items() if k not in ("rss_start_bytes", "rss_end_bytes")}), flush=True)
                serve.delete("pdserve")
    finally:
        serve.shutdown()
        ray.shutdown()
    report = {"machine": describe(), "date": time.strftime("%Y-%m-%d"), "load": args.load, "minutes": args.minutes,
              **summarize(phases), "phases": phases}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "reliability.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "phases"}, indent=1))
    return report


if __name__ == "__main__":
    main()
