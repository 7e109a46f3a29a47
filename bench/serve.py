"""Load generator for any OpenAI-compatible endpoint: ``pdserve bench serve``.

Sends streamed ``/v1/completions`` requests whose prompts are token ids (exact lengths)
and whose outputs run to ``max_tokens`` (``ignore_eos``, as vLLM's benchmark does), with
Poisson arrivals at ``--rate`` requests/s or a fixed ``--concurrency``. Prompt and output
lengths come from a named distribution (``chat``, ``long``) or a JSONL trace of
``{"prompt_tokens": n, "output_tokens": m}`` lines (bench/traces/).

Per request it records TTFT (first streamed text), ITL (gaps between streamed chunks),
TPOT ((end - first token) / (output tokens - 1)) and end-to-end latency; after a warm-up
it reports p50/p90/p99 of each, throughput, and SLO attainment: the share of requests
whose TTFT <= --ttft-slo and TPOT <= --tpot-slo (goodput = that share x request rate, the
DistServe definition: Zhong et al., OSDI 2024, sec. 2.2). Writes JSON and a PNG.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

DISTRIBUTIONS = {
    # (prompt median, prompt sigma, output median, output sigma) of lognormals, clipped:
    # chat ~ ShareGPT-like turns (prompts of a few hundred tokens, answers ~150-250),
    # long ~ summarisation / RAG (prompts of thousands, short answers)
    "chat": (220, 0.9, 180, 0.7),
    "long": (2500, 0.4, 96, 0.5),
}


@dataclass
class RequestSpec:
    prompt_tokens: int
    output_tokens: int


@dataclass
class RequestResult:
    prompt_tokens: int
    output_tokens: int = 0
    ok: bool = False
    error: str = ""
    ttft_s: float = 0.0
    tpot_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)


def load_specs(dataset: str, num: int, seed: int, max_len: int) -> list[RequestSpec]:
    """``num`` request shapes from a named distribution or a JSONL trace (cycled)."""
    rng = random.Random(seed)
    if dataset in DISTRIBUTIONS:
        pm, ps, om, osg = DISTRIBUTIONS[dataset]
        specs = []
        for _ in range(num):
            p = int(min(max(4, rng.lognormvariate(0, ps) * pm), max_len - 64))
            o = int(min(max(2, rng.lognormvariate(0, osg) * om), max_len - p))
            specs.append(RequestSpec(p, o))
        return specs
    lines = [json.loads(line) for line in Path(dataset).read_text().splitlines() if line.strip()]
    return [RequestSpec(int(d["prompt_tokens"]), int(d["output_tokens"])) for d in (lines[i % len(lines)] for i in range(num))]


async def one_request(session, url: str, model: str, spec: RequestSpec, rng: random.Random, timeout_s: float) -> RequestResult:
    result = RequestResult(spec.prompt_tokens)
    body = {"model": model, "prompt": [rng.randrange(1000, 30000) for _ in range(spec.prompt_tokens)],
            "max_tokens": spec.output_tokens, "temperature": 0.0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    last = None
    try:
        async with session.post(url, json=body, timeout=timeout_s) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return result
            async for raw in response.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                payload = json.loads(line[5:])
                if "error" in payload:
                    result.error = str(payload["error"])[:200]
                    return result
                if payload.get("usage"):
                    result.output_tokens = payload["usage"]["completion_tokens"]
                if payload.get("choices") and payload["choices"][0].get("text"):
                    now = time.perf_counter()
                    if last is None:
                        result.ttft_s = now - start
                    else:
                        result.itl_s.append(now - last)
                    last = now
    except Exception as e:  # noqa: BLE001 - a failed request is a data point
        result.error = f"{type(e).__name__}: {e}"[:200]
        return result
    result.e2e_s = time.perf_counter() - start
    result.ok = last is not None
    if result.output_tokens > 1:
        result.tpot_s = (result.e2e_s - result.ttft_s) / (result.output_tokens - 1)
    return result


async def run_load(base_url: str, model: str, specs: list[RequestSpec], rate: float | None, concurrency: int | None,
                   seed: int, timeout_s: float, progress: bool = True) -> tuple[list[RequestResult], float]:
    """Returns (results in send order, wall seconds from first send to last finish)."""
    import aiohttp
    from tqdm import tqdm

    rng = random.Random(seed)
    url = base_url.rstrip("/") + "/completions"
    bar = tqdm(total=len(specs), desc="requests", disable=not progress)
    limit = asyncio.Semaphore(concurrency or len(specs))

    async def guarded(spec):
        async with limit:
            r = await one_request(session, url, model, spec, random.Random(rng.random()), timeout_s)
        bar.update(1)
        return r

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        tasks, start = [], time.perf_counter()
        for spec in specs:
            tasks.append(asyncio.ensure_future(guarded(spec)))
            if rate:  # Poisson arrivals: exponential gaps
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
    bar.close()
    return list(results), wall


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    v = sorted(values)
    pick = lambda q: v[min(len(v) - 1, int(q * len(v)))]  # noqa: E731
    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "mean": sum(v) / len(v)}


def summarize(results: list[RequestResult], wall_s: float, ttft_slo: float, tpot_slo: float) -> dict:
    ok = [r for r in results if r.ok]
    met = [r for r in ok if r.ttft_s <= ttft_slo and (r.output_tokens <= 1 or r.tpot_s <= tpot_slo)]
    return {
        "num_requests": len(results), "num_ok": len(ok), "num_failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "wall_s": wall_s, "request_throughput": len(ok) / wall_s if wall_s else 0.0,
        "output_token_throughput": sum(r.output_tokens for r in ok) / wall_s if wall_s else 0.0,
        "ttft_s": percentiles([r.ttft_s for r in ok]), "tpot_s": percentiles([r.tpot_s for r in ok if r.output_tokens > 1]),
        "itl_s": percentiles([x for r in ok for x in r.itl_s]), "e2e_s": percentiles([r.e2e_s for r in ok]),
        "ttft_slo_s": ttft_slo, "tpot_slo_s": tpot_slo,
        "slo_attainment": len(met) / len(results) if results else 0.0,
        "goodput": len(met) / wall_s if wall_s else 0.0,
    }


def served_model(base_url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(base_url.rstrip("/") + "/models", timeout=30) as r:
        return json.loads(r.read())["data"][0]["id"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default=None, help="default: the first of /v1/models")
    parser.add_argument("--dataset", default="chat", help="chat | long | path to a JSONL trace")
    parser.add_argument("--num-requests", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=2, help="requests sent first and left out of the figures")
    parser.add_argument("--rate", type=float, default=None, help="Poisson arrivals, requests/s (default: all at once)")
    parser.add_argument("--concurrency", type=int, default=None, help="at most this many in flight")
    parser.add_argument("--max-len", type=int, default=8192, help="context limit for drawn lengths")
    parser.add_argument("--ttft-slo", type=float, default=5.0, help="seconds")
    parser.add_argument("--tpot-slo", type=float, default=0.2, help="seconds per output token")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench/out/serve")


def main(args: argparse.Namespace) -> dict:
    model = args.model or served_model(args.base_url)
    specs = load_specs(args.dataset, args.warmup + args.num_requests, args.seed, args.max_len)
    if args.warmup:
        asyncio.run(run_load(args.base_url, model, specs[: args.warmup], None, 1, args.seed, args.timeout, progress=False))
    results, wall = asyncio.run(run_load(args.base_url, model, specs[args.warmup :], args.rate, args.concurrency,
                                         args.seed, args.timeout))
    summary = {"base_url": args.base_url, "model": model, "dataset": args.dataset, "rate": args.rate,
               "concurrency": args.concurrency, **summarize(results, wall, args.ttft_slo, args.tpot_slo)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve.json").write_text(json.dumps({"summary": summary, "requests": [asdict(r) for r in results]}, indent=2))
    print_summary(summary)
    wrote = [out / "serve.json"] + ([out / "serve.png"] if plot_or_say(plot, results, summary, out / "serve.png") else [])
    print("wrote " + " and ".join(map(str, wrote)))
    return summary


def plot_or_say(plot_fn, *args) -> bool:
    """Run ``plot_fn(*args)``; without matplotlib (the ``bench`` extra), say so and go on. True if it plotted."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(f"{args[-1].name} skipped: matplotlib is not installed (bash scripts/install.sh test, or pip install 'pdserve[bench]')")
        return False
    plot_fn(*args)
    return True


def print_summary(s: dict) -> None:
    print(f"\n{s['num_ok']}/{s['num_requests']} ok in {s['wall_s']:.1f} s: {s['request_throughput']:.2f} req/s, "
          f"{s['output_token_throughput']:.1f} output tok/s")
    print(f"{'':>6} | {'p50':>8} | {'p90':>8} | {'p99':>8}   (ms)")
    for name in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        p = s[name]
        row = " | ".join(f"{p[q] * 1e3:8.1f}" if p[q] is not None else f"{'-':>8}" for q in ("p50", "p90", "p99"))
        print(f"{name[:-2].upper():>6} | {row}")
    print(f"SLO attainment (TTFT <= {s['ttft_slo_s']} s and TPOT <= {s['tpot_slo_s']} s): {s['slo_attainment']:.0%}; "
          f"goodput {s['goodput']:.2f} req/s")
    if s["errors"]:
        print("errors:", s["errors"])


def plot(results: list[RequestResult], summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.ok]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, name, values, slo in ((axes[0], "TTFT (s)", [r.ttft_s for r in ok], summary["ttft_slo_s"]),
                                  (axes[1], "TPOT (s)", [r.tpot_s for r in ok if r.output_tokens > 1], summary["tpot_slo_s"])):
        v = sorted(values)
        ax.plot(v, [(i + 1) / len(v) for i in range(len(v))] if v else [], "-")
        ax.axvline(slo, color="r", linestyle=":", label="SLO")
        ax.set(xlabel=name, ylabel="fraction of requests", title=f"{name} CDF")
        ax.legend()
    fig.suptitle(f"{summary['model']} @ {summary['base_url']}: {summary['dataset']}, rate {summary['rate']}, "
                 f"SLO attainment {summary['slo_attainment']:.0%}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(p)
    main(p.parse_args())
