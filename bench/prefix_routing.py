"""TTFT with prefix-aware routing against Ray Serve's power of two choices, 2 prefill replicas.

``bash bench/run.sh prefix_routing`` (or ``python -m bench.prefix_routing``). The workload
is many tenants over few replicas: ``--tenants`` system prompts of ``--system-tokens``
each, every request one of them plus its own ``--user-tokens`` question, and each replica's
KV pool (``--kv-cache-tokens``) too small for every system prompt but large enough for
its share of them. That is where routing decides hit or miss: sent at random, a replica
sees every tenant and its cache churns; sent by prefix (router/prefix_routing.py), each
tenant sticks to one replica, whose cache keeps it.

Each setting deploys 2 prefill replicas (``num_cpus`` 0.5 each) and 1 decode replica
(``pdserve up``), warms every tenant once, then sends ``--requests`` requests (tenants in
random order, 1 output token, at ``--rate`` req/s, Poisson), and reports TTFT p50/p90 and the
prefill pool's prefix-hit share. Writes ``prefix_routing.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

from bench import serve
from bench.hardware import describe

ROOT = Path(__file__).resolve().parents[1]
URL = "http://127.0.0.1:8000/v1"


def config(prefix_routing: bool, kv_cache_tokens: int) -> dict:
    half = {"num_cpus": 0.5, "num_gpus": 0, "resources": {}}
    two = {"min_replicas": 2, "max_replicas": 2, "upscale_delay_s": 10, "downscale_delay_s": 60, "look_back_period_s": 30}
    return {"model": {"max_model_len": 2048},  # so a pool of kv_cache_tokens (a few contexts) is allowed
            "router": {"prefix_routing": prefix_routing},
            "prefill": {"autoscaling_config": two, "ray_actor_options": half, "kv_cache_tokens": kv_cache_tokens}}


async def send(prompts: list[list[int]], rate: float | None, seed: int) -> list[float]:
    """TTFT (s) of each prompt (1 output token), sent as Poisson arrivals at ``rate`` (None: one at a time)."""
    import aiohttp

    rng = random.Random(seed)
    model = serve.served_model(URL)
    async with aiohttp.ClientSession() as session:
        async def one(prompt):
            start = time.perf_counter()
            async with session.post(URL + "/completions", json={"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}) as r:
                body = await r.json()
                if r.status != 200:
                    raise RuntimeError(f"HTTP {r.status}: {body}")
            return time.perf_counter() - start
        if rate is None:
            return [await one(p) for p in prompts]
        tasks = []
        for p in prompts:
            tasks.append(asyncio.ensure_future(one(p)))
            await asyncio.sleep(rng.expovariate(rate))
        return list(await asyncio.gather(*tasks))


_HITS = """
import json, ray
from ray import serve
ray.init(address="auto", log_to_driver=False)
handle, seen = serve.get_deployment_handle("prefill", app_name="pdserve"), {}
for _ in range(200):
    s = handle.stats.remote().result()
    seen[s["replica"]] = s
    if len(seen) == 2:
        break
print(json.dumps([sum(s["num_prefix_hit_blocks"] for s in seen.values()), sum(s["num_tokens_computed"] for s in seen.values())]))
"""


def prefill_hits() -> tuple[int, int]:
    """(prefix-hit blocks, prompt tokens computed) summed over the prefill replicas (asked from a
    process of its own: a Ray connection in this one would outlive the cluster it was made for)."""
    done = subprocess.run([sys.executable, "-c", _HITS], capture_output=True, text=True, check=True, timeout=300)
    hits, computed = json.loads(done.stdout.strip().splitlines()[-1])
    return hits, computed


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.prefix_routing", description=__doc__.split("\n\n")[0])
    p.add_argument("--tenants", type=int, default=6)
    p.add_argument("--system-tokens", type=int, default=1024)
    p.add_argument("--user-tokens", type=int, default=32)
    p.add_argument("--kv-cache-tokens", type=int, default=4096, help="per prefill replica: room for 3 of 6 system prompts")
    p.add_argument("--requests", type=int, default=60)
    p.add_argument("--rate", type=float, default=0.5, help="req/s, Poisson")
    p.add_argument("--seed", type=int, default=int(time.time()) % 100_000)
    p.add_argument("--out", default=str(ROOT / "docs"))
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    systems = [[rng.randrange(100, 40000) for _ in range(args.system_tokens)] for _ in range(args.tenants)]
    order = [rng.randrange(args.tenants) for _ in range(args.requests)]
    prompts = [systems[t] + [rng.randrange(100, 40000) for _ in range(args.user_tokens)] for t in order]
    warm = [s + [rng.randrange(100, 40000) for _ in range(args.user_tokens)] for s in systems]
    cli, rows = [sys.executable, "-m", "pdserve_app.cli"], []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for routing in (False, True):
        path = out / f"cluster-prefix-{routing}.yaml"
        path.write_text(yaml.safe_dump(config(routing, args.kv_cache_tokens)))
        subprocess.run([*cli, "up", str(path), "--redeploy"], check=True, cwd=ROOT, timeout=900)
        try:
            asyncio.run(send(warm, None, args.seed))
            hits0, computed0 = prefill_hits()
            ttfts = sorted(asyncio.run(send(prompts, args.rate, args.seed + 1)))
            hits, computed = prefill_hits()
        finally:
            subprocess.run([*cli, "down"], cwd=ROOT, timeout=300)
            path.unlink()
        prompt_tokens = sum(len(x) for x in prompts)
        row = {"prefix_routing": routing, "ttft_p50_s": statistics.median(ttfts), "ttft_p90_s": ttfts[int(0.9 * (len(ttfts) - 1))],
               "ttft_mean_s": statistics.fmean(ttfts), "prefix_hit_tokens_share": (hits - hits0) * 16 / prompt_tokens,
               "prompt_tokens_computed": computed - computed0}
        print(f"prefix_routing={routing}: TTFT p50 {row['ttft_p50_s']:.3f} s, p90 {row['ttft_p90_s']:.3f} s, "
              f"{row['prefix_hit_tokens_share']:.0%} of prompt tokens from the cache", flush=True)
        rows.append(row)
    result = {"date": time.strftime("%Y-%m-%d"), "machine": describe(), **{k: v for k, v in vars(args).items() if k != "out"}, "rows": rows,
              "ttft_p50_gain": rows[0]["ttft_p50_s"] / rows[1]["ttft_p50_s"], "ttft_p90_gain": rows[0]["ttft_p90_s"] / rows[1]["ttft_p90_s"]}
    (out / "prefix_routing.json").write_text(json.dumps(result, indent=2))
    print(f"TTFT p50 {result['ttft_p50_gain']:.2f}x, p90 {result['ttft_p90_gain']:.2f}x lower with prefix routing; wrote {out / 'prefix_routing.json'}")
    return result


if __name__ == "__main__":
    main()
