"""Goodput: the highest request rate at which at least ``--attainment`` (90%) of requests
meet both the TTFT and the TPOT SLO (DistServe's definition: Zhong et al., "DistServe",
OSDI 2024, sec. 2.2). ``pdserve bench goodput``.

It sweeps Poisson arrival rates against one OpenAI-compatible endpoint (``pdserve bench
serve`` at each rate), then bisects between the last rate that met the target and the
first that missed it. Results are written as JSON under ``--label``; ``--compare`` plots
the attainment-vs-rate curves of earlier runs (e.g. disaggregated vs colocated, deployed
one after the other on the same cores) on one figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from bench import serve


def attainment_at(args, model: str, rate: float, seed: int) -> dict:
    specs = serve.load_specs(args.dataset, args.num_requests, seed, args.max_len)
    results, wall = asyncio.run(serve.run_load(args.base_url, model, specs, rate, None, seed, args.timeout, progress=False))
    summary = serve.summarize(results, wall, args.ttft_slo, args.tpot_slo)
    print(f"rate {rate:6.3f} req/s: attainment {summary['slo_attainment']:.0%}, TTFT p90 {summary['ttft_s']['p90'] or 0:.2f} s, "
          f"TPOT p90 {summary['tpot_s']['p90'] or 0:.3f} s", flush=True)
    return {"rate": rate, **summary}


def sweep(args, model: str) -> tuple[list[dict], float | None]:
    """Rates rising by ``--factor`` from ``--start-rate`` until attainment drops below target
    (or, if the start rate misses, falling by ``--factor`` until one passes, down to ``--min-rate``),
    then ``--bisect`` steps between the last pass and the first miss. Returns (points, goodput);
    goodput None = even the lowest rate tried missed."""
    points, rate, best, miss = [], args.start_rate, None, None
    min_rate = getattr(args, "min_rate", None) or args.start_rate / 8
    while rate >= min_rate * 0.999:  # the start rate already misses: step down to find a rate that passes
        point = attainment_at(args, model, rate, args.seed + len(points))
        points.append(point)
        if point["slo_attainment"] >= args.attainment:
            best, rate = rate, rate * args.factor
            break
        miss, rate = rate, rate / args.factor
    if best is None:
        return sorted(points, key=lambda p: p["rate"]), None
    if miss is not None:  # found on the way down: bisect between it and the rate above
        rate = args.max_rate * 2  # skip the upward sweep
    while rate <= args.max_rate:
        point = attainment_at(args, model, rate, args.seed + len(points))
        points.append(point)
        if point["slo_attainment"] >= args.attainment:
            best, rate = rate, rate * args.factor
        else:
            miss = rate
            break
    if best is not None and miss is not None:
        lo, hi = best, miss
        for _ in range(args.bisect):
            mid = (lo + hi) / 2
            point = attainment_at(args, model, mid, args.seed + len(points))
            points.append(point)
            lo, hi = (mid, hi) if point["slo_attainment"] >= args.attainment else (lo, mid)
        best = lo
    return sorted(points, key=lambda p: p["rate"]), best


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="pdserve bench goodput", description=__doc__.split("\n\n")[0])
    serve.add_arguments(parser)
    parser.set_defaults(num_requests=20, out="bench/out/goodput")
    parser.add_argument("--label", default="pdserve", help="name of this configuration in the JSON and the plot")
    parser.add_argument("--attainment", type=float, default=0.9, help="share of requests that must meet both SLOs")
    parser.add_argument("--start-rate", type=float, default=0.1, help="requests/s")
    parser.add_argument("--factor", type=float, default=2.0, help="rate multiplier per sweep step")
    parser.add_argument("--max-rate", type=float, default=64.0)
    parser.add_argument("--min-rate", type=float, default=None, help="lowest rate tried when the start rate misses (default: start / 8)")
    parser.add_argument("--bisect", type=int, default=2, help="bisection steps after the sweep")
    parser.add_argument("--compare", nargs="*", default=[], help="earlier goodput JSON files to plot beside this run")
    args = parser.parse_args(argv)
    model = args.model or serve.served_model(args.base_url)
    points, goodput = sweep(args, model)
    result = {"label": args.label, "base_url": args.base_url, "model": model, "dataset": args.dataset,
              "ttft_slo_s": args.ttft_slo, "tpot_slo_s": args.tpot_slo, "attainment_target": args.attainment,
              "goodput_rps": goodput, "points": points}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"goodput-{args.label}.json"
    path.write_text(json.dumps(result, indent=2))
    runs = [result] + [json.loads(Path(p).read_text()) for p in args.compare]
    for run in runs:
        print(f"{run['label']}: goodput {run['goodput_rps'] if run['goodput_rps'] is not None else 'below the start rate'} req/s "
              f"at >= {run['attainment_target']:.0%} attainment (TTFT <= {run['ttft_slo_s']} s, TPOT <= {run['tpot_slo_s']} s)")
    plotted = serve.plot_or_say(plot, runs, out / "goodput.png")
    print(f"wrote {path}" + (f" and {out / 'goodput.png'}" if plotted else ""))
    return result


def plot(runs: list[dict], path: Path) -> None:
    """Attainment-vs-rate curves of ``runs`` (this module's JSON) on one figure."""
    title = f"{Path(runs[0]['dataset']).name}: TTFT <= {runs[0]['ttft_slo_s']} s, TPOT <= {runs[0]['tpot_slo_s']} s"
    plot_attainment([(run["label"], [p["rate"] for p in run["points"]], [p["slo_attainment"] for p in run["points"]]) for run in runs],
                    runs[0]["attainment_target"], title, path)


def plot_attainment(curves: list[tuple[str, list[float], list[float]]], target: float, title: str, path: Path) -> None:
    """One figure: SLO attainment (0-1) against request rate (req/s, log axis) per (label, rates,
    attainments), with the target as a dotted line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for label, rates, attainments in curves:
        ax.plot(rates, attainments, "o-", label=label)
    ax.axhline(target, color="k", linestyle=":", label="target")
    ax.set(xscale="log", xlabel="offered request rate (req/s, Poisson)", ylabel="share meeting both SLOs", ylim=(0, 1.05), title=title)
    ax.title.set_fontsize(9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
