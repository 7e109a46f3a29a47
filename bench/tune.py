"""P:D ratio tuning: ``pdserve tune``.

Following DistServe (Zhong et al., OSDI 2024, sec. 4), it profiles one prefill replica and
one decode replica of the model on this machine, then predicts, for each split of
``--workers`` replicas into n_p prefill + n_d decode, the goodput: the highest Poisson rate
at which at least ``--attainment`` of requests meet both SLOs. The prediction is a
discrete-event simulation of the workload (lengths from ``--dataset``):

- prefill: n_p FCFS servers, one prompt at a time, service time from the profiled prefill
  latency fit ``a + b L + c L^2`` (L = prompt tokens); TTFT = queueing + service;
- decode: n_d servers running continuous batching; every step serves each running request
  one token and takes the profiled step time ``d + e B`` at batch size B; TPOT = the mean
  step time a request saw. KV transfer is left out (under 1% of TTFT here, bench/transfer.py).
- with ``router.local_prefill_queue_s`` (the default mode: conditional disaggregation), a
  prompt that would wait longer for the prefill pool is prefilled by a decode replica in
  chunks between its steps (bench/sim_conditional.py);
- with ``decode.yield_to_prefill_s`` (pdserve/core_share.py), a decode step due while a
  prefill runs waits for its end, at most that long, and the prefill fit is the profile on
  the threads the prefill replica borrows; the wait counts in the requests' TPOT.

Colocated (``mode: colocated``: one replica on all ``--workers`` cores) is simulated too,
from a second profile on that many threads: one engine whose every step serves the running
requests a token each and fills the rest of its token budget (``max_num_batched_tokens``,
512) with prompt chunks in arrival order, as engine/scheduler.py does; a step costs
``d + e B`` plus the chunk's share of the prefill fit (``b n + c ((s + n)^2 - s^2)`` for n
tokens from position s; ``a`` instead of ``d`` when no request decodes). A prompt's first
token comes with the step that finishes it.

It prints the predicted goodput of every split and of colocated, per core too, and writes
the best split as a cluster.yaml fragment. ``--check URL`` runs ``pdserve bench goodput``
against a deployed cluster (e.g. the recommended split) and prints predicted against
measured. ``bench/run.sh compare`` prints these predictions beside its measurements.
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import json
import random
import time
from pathlib import Path

from bench import serve
from bench.sim_conditional import mixed_step, simulate_conditional


def profile(model_name: str, dtype: str, prompt_lengths: list[int], batches: list[int], context: int, threads: int = 1) -> dict:
    """Seconds per prefill at each prompt length, per decode step at each batch size, on an
    engine with ``threads`` threads (a replica's CPUs)."""
    import torch

    from bench.engine import DECODE_STEPS_PER_REPEAT, pdserve_decode_step, pdserve_prefill
    from pdserve.engine.engine import Engine, EngineConfig
    from pdserve.model_loader import load_model, resolve_model_dir

    torch.set_num_threads(threads)
    model = load_model(resolve_model_dir(model_name), dtype)
    blocks = max(max(batches) * -(-(context + DECODE_STEPS_PER_REPEAT * 2 + 2) // 16), -(-max(prompt_lengths) // 16)) + 8
    engine = Engine(model, EngineConfig(num_blocks=blocks, max_num_seqs=max(batches), enable_prefix_caching=False), frozenset(), 8192)
    prefill = {n: pdserve_prefill(engine, n, repeats=1) for n in prompt_lengths}
    decode = {b: pdserve_decode_step(engine, b, context, repeats=2) for b in batches}
    return {"model": model_name, "dtype": dtype, "context": context, "threads": threads,
            "prefill_s": {str(k): v for k, v in prefill.items()}, "decode_step_s": {str(k): v for k, v in decode.items()}}


def fit(profile_: dict) -> tuple[tuple[float, float, float], tuple[float, float]]:
    """Least-squares (a, b, c) of prefill seconds = a + b L + c L^2, and (d, e) of step seconds = d + e B."""
    import numpy as np

    lengths = np.array([float(k) for k in profile_["prefill_s"]])
    t = np.array(list(profile_["prefill_s"].values()))
    a, b, c = np.linalg.lstsq(np.stack([np.ones_like(lengths), lengths, lengths**2], 1), t, rcond=None)[0]
    batch = np.array([float(k) for k in profile_["decode_step_s"]])
    s = np.array(list(profile_["decode_step_s"].values()))
    d, e = np.linalg.lstsq(np.stack([np.ones_like(batch), batch], 1), s, rcond=None)[0]
    return (max(a, 0.0), max(b, 0.0), max(c, 0.0)), (max(d, 1e-4), max(e, 0.0))


def calibrate(prefill_fit, decode_fit, prompt_tokens: int, ttft_s: float, tpot_s: float):
    """The fits scaled so that a lone request of ``prompt_tokens`` gets the TTFT and TPOT
    (seconds) measured through the deployed system: every prefill coefficient by
    ``ttft_s / (a + b L + c L^2)``, every decode one by ``tpot_s / (d + e)``. The engine's
    profile runs alone in a quiet process; served, the same steps also carry the router, the
    proxy, the meter and a replica's own threads (docs/serving.md), which one lone request
    measures. Returns ``(prefill_fit, decode_fit)``; the fits unchanged where a figure is
    missing or not positive."""
    a, b, c = prefill_fit
    d, e = decode_fit
    engine_ttft, engine_tpot = a + b * prompt_tokens + c * prompt_tokens**2, d + e
    sp = ttft_s / engine_ttft if ttft_s and ttft_s > 0 and engine_ttft > 0 else 1.0
    sd = tpot_s / engine_tpot if tpot_s and tpot_s > 0 and engine_tpot > 0 else 1.0
    return (a * sp, b * sp, c * sp), (d * sd, e * sd)


def _union(intervals: list[tuple[float, float]]) -> tuple[list[float], list[float]]:
    """Starts and ends of the union of ``intervals``, sorted."""
    starts, ends = [], []
    for s, e in sorted(intervals):
        if ends and s <= ends[-1]:
            ends[-1] = max(ends[-1], e)
        else:
            starts.append(s)
            ends.append(e)
    return starts, ends


def simulate(specs: list[serve.RequestSpec], rate: float, n_prefill: int, n_decode: int, prefill_fit, decode_fit, seed: int = 0,
             yield_s: float = 0.0):
    """(TTFT, TPOT) per request, in seconds, for Poisson arrivals at ``rate``; ``yield_s`` > 0:
    a decode step due while a prefill runs waits for its end, at most ``yield_s`` (every
    replica on one node, as decode.yield_to_prefill_s has them)."""
    rng = random.Random(seed)
    a, b, c = prefill_fit
    d, e = decode_fit
    t, free_at = 0.0, [0.0] * n_prefill
    ready = []  # (time the first token is out, index)
    busy = []  # prefill service intervals
    ttft = [0.0] * len(specs)
    for i, spec in enumerate(specs):
        t += rng.expovariate(rate)
        k = min(range(n_prefill), key=free_at.__getitem__)
        start = max(t, free_at[k])
        free_at[k] = start + a + b * spec.prompt_tokens + c * spec.prompt_tokens**2
        busy.append((start, free_at[k]))
        ttft[i] = free_at[k] - t
        ready.append((free_at[k], i))
    ready.sort()
    starts, ends = _union(busy) if yield_s > 0 else ([], [])
    # decode: each replica steps its whole batch; a request joins at the first step after its first token
    left = [max(spec.output_tokens - 1, 0) for spec in specs]
    step_sum, step_count = [0.0] * len(specs), [0] * len(specs)
    clocks, batches = [0.0] * n_decode, [[] for _ in range(n_decode)]
    pending = list(ready)  # sorted by ready time
    heapq.heapify(pending)
    while pending or any(batches):
        # the replica that acts next: the earliest clock among busy ones, or an idle one when work is ready
        k = min(range(n_decode), key=lambda j: clocks[j] if batches[j] else max(clocks[j], pending[0][0]) if pending else float("inf"))
        if not batches[k]:
            clocks[k] = max(clocks[k], pending[0][0])
        while pending and pending[0][0] <= clocks[k]:
            _, i = heapq.heappop(pending)
            if left[i] > 0:
                batches[k].append(i)
        if not batches[k]:
            continue
        step = d + e * len(batches[k])
        j = bisect.bisect_right(starts, clocks[k]) - 1
        if j >= 0 and clocks[k] < ends[j]:  # a prefill is running: the step waits for it (at most yield_s)
            step += min(ends[j], clocks[k] + yield_s) - clocks[k]
        clocks[k] += step
        still = []
        for i in batches[k]:
            step_sum[i] += step
            step_count[i] += 1
            left[i] -= 1
            if left[i]:
                still.append(i)
        batches[k] = still
    tpot = [s / n if n else 0.0 for s, n in zip(step_sum, step_count)]
    return ttft, tpot


def simulate_colocated(specs: list[serve.RequestSpec], rate: float, prefill_fit, decode_fit, budget: int = 512, seed: int = 0):
    """(TTFT, TPOT) per request, in seconds, for Poisson arrivals at ``rate`` on one engine
    that mixes decodes and prompt chunks in each step (module docstring; ``budget``: its
    ``max_num_batched_tokens``, also the chunk size)."""
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for _ in specs:
        t += rng.expovariate(rate)
        arrivals.append(t)
    ttft, tpot = [0.0] * len(specs), [0.0] * len(specs)
    step_sum, left = [0.0] * len(specs), [max(spec.output_tokens - 1, 0) for spec in specs]
    done = [0] * len(specs)  # prompt tokens computed
    running: list[int] = []  # decoding
    nxt, clock = 0, 0.0
    waiting: list[int] = []  # arrived, prompt not finished, in arrival order
    while nxt < len(specs) or waiting or running:
        if not waiting and not running:
            clock = max(clock, arrivals[nxt])
        while nxt < len(specs) and arrivals[nxt] <= clock:
            waiting.append(nxt)
            nxt += 1
        chunks, step = mixed_step(len(running), waiting, done, specs, budget, prefill_fit, decode_fit)
        clock += step
        still = []
        for i in running:
            step_sum[i] += step
            left[i] -= 1
            if left[i]:
                still.append(i)
            else:
                tpot[i] = step_sum[i] / max(specs[i].output_tokens - 1, 1)
        running = still
        for i, n in chunks:
            done[i] += n
            if done[i] == specs[i].prompt_tokens:
                waiting.remove(i)
                ttft[i] = clock - arrivals[i]
                if left[i]:
                    running.append(i)
    return ttft, tpot


def attainment(ttft, tpot, ttft_slo, tpot_slo) -> float:
    return sum(1 for x, y in zip(ttft, tpot) if x <= ttft_slo and y <= tpot_slo) / len(ttft)


def predicted_goodput(specs, n_prefill, n_decode, prefill_fit, decode_fit, ttft_slo, tpot_slo, target, max_rate=256.0,
                      yield_s: float = 0.0, local_queue_s: float | None = None) -> float:
    """Highest rate (req/s) with simulated attainment >= target; 0 if none. n_prefill 0:
    colocated (``simulate_colocated``, n_decode its token budget); ``yield_s`` as ``simulate``'s;
    ``local_queue_s``: conditional disaggregation (``router.local_prefill_queue_s``,
    bench/sim_conditional.py), None: every prompt through the prefill pool."""
    lo, hi = 0.0, max_rate
    for _ in range(14):
        mid = (lo + hi) / 2
        ok = predicted_attainment(specs, mid, n_prefill, n_decode, prefill_fit, decode_fit, ttft_slo, tpot_slo, yield_s, local_queue_s) >= target
        lo, hi = (mid, hi) if ok else (lo, mid)
    return lo


def predicted_attainment(specs, rate, n_prefill, n_decode, prefill_fit, decode_fit, ttft_slo, tpot_slo, yield_s: float = 0.0,
                         local_queue_s: float | None = None) -> float:
    """Simulated share of requests meeting both SLOs at ``rate`` (n_prefill 0: colocated, n_decode its token budget)."""
    if n_prefill == 0:
        ttft, tpot = simulate_colocated(specs, rate, prefill_fit, decode_fit, n_decode)
    elif local_queue_s is not None:
        ttft, tpot, _ = simulate_conditional(specs, rate, n_prefill, n_decode, prefill_fit, decode_fit, local_queue_s)
    else:
        ttft, tpot = simulate(specs, rate, n_prefill, n_decode, prefill_fit, decode_fit, yield_s=yield_s)
    return attainment(ttft, tpot, ttft_slo, tpot_slo)


def fragment(n_prefill: int, n_decode: int, local_queue_s: float | None = 0.05) -> str:
    def pool(name, n):
        return (f"{name}:\n  autoscaling_config:\n    min_replicas: {n}\n    max_replicas: {n}\n"
                f"  ray_actor_options:\n    num_cpus: 1\n")
    router = f"router:\n  local_prefill_queue_s: {'null' if local_queue_s is None else f'{local_queue_s:g}'}\n"
    return "# written by pdserve tune\nmode: disaggregated\n" + pool("prefill", n_prefill) + pool("decode", n_decode) + router


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="pdserve tune", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--dataset", default="chat", help="chat | long | JSONL trace (see bench/traces)")
    parser.add_argument("--workers", type=int, default=2, help="replicas (one core each) to split between the pools; colocated gets them all")
    parser.add_argument("--colocated-budget", type=int, default=512, help="the colocated pool's max_num_batched_tokens")
    parser.add_argument("--ttft-slo", type=float, default=5.0)
    parser.add_argument("--tpot-slo", type=float, default=0.2)
    parser.add_argument("--attainment", type=float, default=0.9)
    parser.add_argument("--local-prefill-queue-s", default="0.05",
                        help="router.local_prefill_queue_s of the splits (conditional disaggregation, the default); none: every prompt through prefill")
    parser.add_argument("--num-requests", type=int, default=400, help="simulated requests per rate")
    parser.add_argument("--profile", default=None, help="reuse a profile JSON (profile.json: one thread, and colocated's) instead of profiling")
    parser.add_argument("--prompt-lengths", default="64,256,1024,2048")
    parser.add_argument("--batches", default="1,4,16,32")
    parser.add_argument("--check", default=None, help="OpenAI base URL of a deployed cluster to measure goodput on")
    parser.add_argument("--out", default="bench/out/tune")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    specs = serve.load_specs(args.dataset, args.num_requests, 0, 8192)
    if args.profile:
        profiles = json.loads(Path(args.profile).read_text())
    else:
        mean_ctx = int(sum(s.prompt_tokens + s.output_tokens / 2 for s in specs) / len(specs))
        start = time.perf_counter()
        profiles = {str(n): profile(args.model, args.dtype, [int(x) for x in args.prompt_lengths.split(",")],
                                    [int(x) for x in args.batches.split(",")], mean_ctx, n) for n in sorted({1, args.workers})}
        print(f"profiled in {time.perf_counter() - start:.0f} s", flush=True)
        (out / "profile.json").write_text(json.dumps(profiles, indent=2))
    if "prefill_s" in profiles:  # one profile (one thread): no colocated prediction
        profiles = {"1": profiles}
    prefill_fit, decode_fit = fit(profiles["1"])
    local_s = None if args.local_prefill_queue_s.lower() in ("none", "null") else float(args.local_prefill_queue_s)
    rows = []
    for n_p in range(1, args.workers):
        n_d = args.workers - n_p
        g = predicted_goodput(specs, n_p, n_d, prefill_fit, decode_fit, args.ttft_slo, args.tpot_slo, args.attainment, local_queue_s=local_s)
        rows.append({"prefill": n_p, "decode": n_d, "predicted_goodput_rps": g, "per_replica_rps": g / args.workers})
    rows.sort(key=lambda r: -r["predicted_goodput_rps"])
    best = rows[0] if rows else None
    colocated = None
    if str(args.workers) in profiles:
        c_prefill, c_decode = fit(profiles[str(args.workers)])
        g = predicted_goodput(specs, 0, args.colocated_budget, c_prefill, c_decode, args.ttft_slo, args.tpot_slo, args.attainment)
        colocated = {"threads": args.workers, "predicted_goodput_rps": g, "per_core_rps": g / args.workers, "prefill_fit_s": c_prefill,
                     "decode_step_fit_s": c_decode}
    print(f"\n{'P:D':>5} | {'goodput req/s':>13} | {'per replica':>11}   ({args.dataset}, TTFT <= {args.ttft_slo} s, TPOT <= {args.tpot_slo} s, "
          f"{args.attainment:.0%})")
    for r in rows:
        print(f"{r['prefill']}:{r['decode']:<3} | {r['predicted_goodput_rps']:>13.3f} | {r['per_replica_rps']:>11.3f}")
    if colocated:
        print(f"{'coloc':>5} | {colocated['predicted_goodput_rps']:>13.3f} | {colocated['per_core_rps']:>11.3f}   (one replica, {args.workers} threads)")
    result = {"dataset": args.dataset, "workers": args.workers, "local_prefill_queue_s": local_s, "ttft_slo_s": args.ttft_slo, "tpot_slo_s": args.tpot_slo,
              "attainment": args.attainment, "prefill_fit_s": prefill_fit, "decode_step_fit_s": decode_fit, "splits": rows,
              "colocated": colocated}
    if best:
        (out / "cluster-fragment.yaml").write_text(fragment(best["prefill"], best["decode"], local_s))
        print(f"\nrecommended: {best['prefill']} prefill : {best['decode']} decode -> {out / 'cluster-fragment.yaml'}")
    if args.check and best:
        from bench import goodput

        measured = goodput.main(["--base-url", args.check, "--dataset", args.dataset, "--ttft-slo", str(args.ttft_slo),
                                 "--tpot-slo", str(args.tpot_slo), "--attainment", str(args.attainment),
                                 "--label", f"{best['prefill']}P{best['decode']}D", "--out", str(out)])
        result["check"] = {"split": f"{best['prefill']}:{best['decode']}", "predicted_rps": best["predicted_goodput_rps"],
                           "measured_rps": measured["goodput_rps"]}
        print(f"check: predicted {best['predicted_goodput_rps']:.3f} req/s, measured {measured['goodput_rps']} req/s")
    (out / "tune.json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
