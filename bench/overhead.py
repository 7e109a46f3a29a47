"""Serving overhead: TPOT through ``pdserve up`` divided by the engine's own decode step.

``bash bench/run.sh overhead`` (or ``python -m bench.overhead``). For each batch B in
``--batches`` (default 1 and 8):

1. *Engine alone*: the decode pool's engine, built in this process exactly as a decode
   replica builds it (``pdserve.worker.build_engine``, 1 torch thread, the default config),
   runs B requests of ``--prompt`` tokens to ``--output`` tokens; the engine figure is the
   mean wall time of the steps in which all B were decoding.
2. *Served*: the default cluster (1 prefill + 1 decode replica, ``pdserve up``), driven by
   pdserve's meter (``bench/serve.py``) with B requests in flight at all times (closed
   loop, the load that keeps B decoding), ``--requests-per-batch`` requests of the same
   lengths; TPOT per request is (last token - first token) / (output tokens - 1), and the
   figure is the median.
3. The ratio TPOT p50 / engine step: 1.0 means serving costs nothing beyond the step.

While the served load runs it samples every process's CPU time (/proc/PID/stat) and
reports each Ray process's share of a core, grouped by name (decode replica, prefill
replica, Serve controller, proxy, router, raylet, GCS ...), to show where the rest goes.
Writes ``overhead.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from bench import serve
from bench.hardware import describe

ROOT = Path(__file__).resolve().parents[1]
URL = "http://127.0.0.1:8000/v1"
TICKS = os.sysconf("SC_CLK_TCK")


def engine_step_s(batch: int, prompt: int, output: int) -> float:
    """Mean seconds per engine step while all ``batch`` requests decode (the decode pool's engine)."""
    from pdserve.config import ClusterConfig
    from pdserve.engine.sequence import Sequence
    from pdserve.sampling import SamplingParams
    from pdserve.worker import build_engine

    engine, _ = build_engine(ClusterConfig.from_dict({}), "decode")
    gen = torch.Generator().manual_seed(batch)
    seqs = [Sequence(f"o{i}", torch.randint(100, 40000, (prompt,), generator=gen).tolist(), prompt,
                     SamplingParams(max_tokens=output, ignore_eos=True)) for i in range(batch)]
    for seq in seqs:
        engine.add(seq)
    times = []
    while engine.scheduler.has_work():
        decoding = all(s.num_computed_tokens >= s.num_prompt_tokens and s.finish_reason is None for s in seqs)
        start = time.perf_counter()
        engine.step()
        if decoding:
            times.append(time.perf_counter() - start)
    return statistics.fmean(times[2:])  # the first steps warm the caches


def engine_prefill_s(prompt: int, repeats: int = 3) -> float:
    """Median seconds of the prefill pool's engine to prefill one ``prompt``-token prompt (first token included)."""
    from pdserve.config import ClusterConfig
    from pdserve.engine.sequence import Sequence
    from pdserve.sampling import SamplingParams
    from kv_transfer.factory import prefill_pool_memory
    from pdserve.worker import build_engine

    cfg = ClusterConfig.from_dict({})
    engine, _ = build_engine(cfg, "prefill", kv_memory=lambda *a: prefill_pool_memory(cfg.kv_transfer, *a))  # as a prefill replica
    gen, times = torch.Generator().manual_seed(prompt), []
    for i in range(repeats + 1):
        seq = Sequence(f"p{i}", torch.randint(100, 40000, (prompt,), generator=gen).tolist(), prompt, SamplingParams(max_tokens=1))
        engine.add(seq)
        start = time.perf_counter()
        while engine.scheduler.has_work():
            engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def cpu_seconds() -> dict[int, tuple[str, float]]:
    """pid -> (process name, user + system CPU seconds so far) for every process."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            cmd = (d / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace") or stat[stat.index("(") + 1:stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2:].split()
            out[int(d.name)] = (cmd, (int(fields[11]) + int(fields[12])) / TICKS)
        except (OSError, ValueError, IndexError):
            continue
    return out


def name_of(cmd: str) -> str:
    """A stable group name: Ray's actor title (ray::ServeReplica:pdserve:decode) or the program."""
    if cmd.startswith("ray::"):
        return cmd.split(" ")[0]
    return Path(cmd.split(" ")[0]).name


def served_tpot(batch: int, prompt: int, output: int, num_requests: int, seed: int) -> tuple[dict, dict[str, float]]:
    """TPOT figures (s) at ``batch`` requests in flight, and each process group's CPU share (cores)."""
    model = serve.served_model(URL)
    warm = [serve.RequestSpec(prompt, 8)] * batch
    asyncio.run(serve.run_load(URL, model, warm, None, batch, seed, 600, progress=False))
    specs = [serve.RequestSpec(prompt, output)] * num_requests  # the meter draws fresh random token ids per request
    before, t0 = cpu_seconds(), time.monotonic()
    results, wall = asyncio.run(serve.run_load(URL, model, specs, None, batch, seed + 1, 1800, progress=False))
    after, elapsed = cpu_seconds(), time.monotonic() - t0
    shares: dict[str, float] = defaultdict(float)
    for pid, (cmd, cpu) in after.items():
        shares[name_of(cmd)] += (cpu - before.get(pid, (cmd, 0.0))[1]) / elapsed
    ok = [r for r in results if r.ok]
    if len(ok) < len(results):
        raise RuntimeError(f"{len(results) - len(ok)} requests failed: {next(r.error for r in results if not r.ok)}")
    tpots = sorted(r.tpot_s for r in ok)
    figures = {"tpot_p50_s": statistics.median(tpots), "tpot_p90_s": tpots[int(0.9 * (len(tpots) - 1))],
               "ttft_p50_s": statistics.median(r.ttft_s for r in ok), "requests": len(ok), "wall_s": wall}
    return figures, {k: round(v, 3) for k, v in sorted(shares.items(), key=lambda kv: -kv[1]) if v >= 0.005}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,8")
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--output", type=int, default=128)
    p.add_argument("--requests-per-batch", type=int, default=3, help="requests per stream slot (B x this in all)")
    p.add_argument("--config", default=None, help="cluster.yaml for the served run (default: the embedded default)")
    p.add_argument("--seed", type=int, default=int(time.time()) % 100_000)
    p.add_argument("--out", default=str(ROOT / "docs"))
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    torch.set_num_threads(1)
    engine = {b: engine_step_s(b, args.prompt, args.output) for b in batches}
    prefill = engine_prefill_s(args.prompt)
    for b, s in engine.items():
        print(f"engine alone, batch {b}: {s * 1e3:.1f} ms/step", flush=True)
    print(f"engine alone, prefill of {args.prompt} tokens: {prefill * 1e3:.0f} ms", flush=True)
    cli = [sys.executable, "-m", "pdserve_app.cli"]
    subprocess.run([*cli, "up", *([args.config] if args.config else []), "--redeploy"], check=True, cwd=ROOT, timeout=900)
    rows = []
    try:
        for b in batches:
            figures, shares = served_tpot(b, args.prompt, args.output, b * args.requests_per_batch, args.seed + 10 * b)
            ratio = figures["tpot_p50_s"] / engine[b]
            print(f"served, {b} in flight: TPOT p50 {figures['tpot_p50_s'] * 1e3:.1f} ms = {ratio:.2f}x the engine step; CPU (cores): {shares}",
                  flush=True)
            rows.append({"batch": b, "engine_step_s": engine[b], **figures, "tpot_over_engine_step": ratio, "engine_prefill_s": prefill,
                         "ttft_over_engine_prefill": figures["ttft_p50_s"] / prefill, "cpu_cores_by_process": shares})
    finally:
        subprocess.run([*cli, "down"], cwd=ROOT, timeout=300)
    targets = {1: 1.10, 8: 1.25}
    result = {"date": time.strftime("%Y-%m-%d"), "machine": describe(), "config": args.config or "embedded default (1 prefill + 1 decode)",
              "prompt_tokens": args.prompt, "output_tokens": args.output, "rows": rows,
              "targets": {str(b): {"target": t, "measured": next((r["tpot_over_engine_step"] for r in rows if r["batch"] == b), None)}
                          for b, t in targets.items()}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "overhead.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {out / 'overhead.json'}")
    return result


if __name__ == "__main__":
    main()
