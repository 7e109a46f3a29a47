"""KV hand-off time per pair of tensor-parallel sizes, prefill TP=p -> decode TP=d, over each
transport: part of ``bash bench/run.sh transfer`` (``--tp-pairs``), or
``python -m bench.transfer_tp``.

bench/tensor_parallel.py's random Llama (8 heads, 4 KV heads of 64, 30 layers: 30 KiB of
bf16 KV per token), saved with the bundled tokenizer. Per pair and transport, a prefill
worker at TP=p and a decode worker at TP=d (the worker classes a replica runs, without Ray
Serve) serve ``repeats`` prompts of ``tokens`` tokens; the hand-off time is the decode
worker's fetch, from the call to the acknowledged return (kv_transfer/client.py
``fetch_seconds``), per prompt. Every rank's pool holds whole KV heads, so each pair moves
the same bytes; the figures say whether the TP size changes what the transfer costs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import tempfile
import time
from pathlib import Path

from bench import hardware
from bench.tensor_parallel import write_checkpoint
from pdserve.model_loader import resolve_model_dir


def _worker_config(path: Path, dtype: str, backend: str, p: int, d: int, tokens: int) -> dict:
    pool = {"kv_cache_tokens": 2 * (tokens + 64), "block_size": 16, "num_threads": 1}
    return {"model": {"path": str(path), "dtype": dtype, "max_model_len": tokens + 64},
            "prefill": {**pool, "kv_lease_s": 60, "tensor_parallel_size": p}, "decode": {**pool, "tensor_parallel_size": d},
            "kv_transfer": {"backend": backend, "bind_host": "127.0.0.1", "timeout_s": 30.0}}


def _pair(path: Path, dtype: str, backend: str, p: int, d: int, tokens: int, repeats: int) -> dict:
    from decode_worker.server import DecodeServer
    from pdserve.messages import PrefillRequest, WithKV
    from pdserve.sampling import SamplingParams
    from prefill_worker.server import PrefillServer

    config = _worker_config(path, dtype, backend, p, d, tokens)
    prefill, decode = PrefillServer(config), DecodeServer(config)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    per_fetch = []

    async def one(i: int) -> None:
        prompt = [1, *((7 * i + j) % 40000 + 100 for j in range(tokens - 1))]
        first = await prefill.prefill(PrefillRequest(f"tp{p}{d}-{i}", prompt, params))
        before = (await decode.stats())["kv_fetch_seconds"]
        async for _ in decode.generate(WithKV(f"tp{p}{d}-{i}", prompt, params, first.first_token, first.kv)):
            pass
        per_fetch.append((await decode.stats())["kv_fetch_seconds"] - before)

    try:
        for i in range(repeats + 1):  # the first warms both sides' buffers and channels up
            asyncio.run(one(i))
        stats = asyncio.run(decode.stats())
    finally:
        for server in (prefill, decode):
            server.loop.close(wait_s=30)
            server.__del__()
    times = sorted(per_fetch[1:])
    nbytes = stats["kv_bytes_fetched"] / stats["kv_num_fetched"]
    return {"backend": backend, "prefill_tp": p, "decode_tp": d, "tokens": tokens, "bytes": nbytes,
            "median_s": times[len(times) // 2], "GB_per_s": nbytes / times[len(times) // 2] / 1e9}


def measure_pairs(pairs: list[tuple[int, int]], backends: list[str], tokens: int, repeats: int, dtype: str) -> list[dict]:
    """One row per (backend, p, d): median hand-off seconds of ``repeats`` prompts of ``tokens`` tokens."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        write_checkpoint(path)
        for f in resolve_model_dir("smollm2").glob("*"):
            if f.name.startswith(("tokenizer", "special_tokens")) or f.suffix == ".jinja":
                shutil.copy(f, path / f.name)
        for backend in backends:
            for p, d in pairs:
                rows.append(_pair(path, dtype, backend, p, d, tokens, repeats))
                print(f"{backend:5s} P(TP={p}) -> D(TP={d}): {rows[-1]['bytes'] / 2**20:7.1f} MiB in {rows[-1]['median_s'] * 1e3:7.1f} ms "
                      f"({rows[-1]['GB_per_s']:.2f} GB/s)", flush=True)
    return rows


def parse_pairs(text: str) -> list[tuple[int, int]]:
    """"1:1,2:1" -> [(1, 1), (2, 1)]."""
    return [tuple(int(x) for x in pair.split(":")) for pair in text.split(",") if pair]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp-pairs", default="1:1,1:2,2:1,2:2", help="prefill:decode TP sizes")
    parser.add_argument("--backends", default="grpc,shm")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", default="bench/out/transfer_tp.json")
    args = parser.parse_args()
    rows = measure_pairs(parse_pairs(args.tp_pairs), args.backends.split(","), args.tokens, args.repeats, args.dtype)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), **hardware.describe(), "dtype": args.dtype, "pairs": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
