"""How much of the KV transfer layer-wise streaming hides behind prefill compute.

A prefill process (the bundled model, one torch thread, a KVServer on loopback, as a
prefill worker) and a receiving process (this one, fetching over ``grpc`` into its own
paged pool, as a decode worker) run one prompt two ways:

- ``serial``: prefill runs to the end, then the KV is leased and fetched (the default);
- ``layerwise``: the KV is leased when prefill starts and fetched while it computes,
  each layer as soon as it is written (``kv_transfer.layerwise``, kv_transfer/progress.py).

Both are timed from the request to the KV (and the first token) being in the receiver's
blocks. What decode still waits for after prefill ends is the transfer's exposed part:
serial, the whole fetch; layerwise, the tail after the last layer (total minus prefill
compute). hidden = 1 - layerwise tail / serial transfer. The sender's copies compete
with prefill for its core, so the run also reports prefill's compute time in each mode
(their ratio is the cost of streaming; on this shared machine it moves by ~10% between
runs, more than the transfer itself).

Run from ``bash bench/run.sh transfer`` (bench/transfer.py), or
``python -m bench.overlap --lengths 512,2048``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import time

import torch

BLOCK_SIZE = 16


def _prefill_process(conn, model_name: str, dtype: str, max_tokens: int) -> None:
    """Sender: for each (num_tokens, mode) it receives, prefill a random prompt, send the
    KV handle (at the start for layerwise, at the end for serial), then the compute seconds."""
    from kv_transfer.paged import PagedKVSource
    from kv_transfer.progress import LayerProgress, StreamedKVSource
    from kv_transfer.server import KVServer
    from pdserve.engine.engine import Engine, EngineConfig
    from pdserve.engine.sequence import Sequence
    from pdserve.model_loader import load_model, resolve_model_dir
    from pdserve.sampling import SamplingParams

    torch.set_num_threads(1)
    model = load_model(resolve_model_dir(model_name), dtype)
    config = EngineConfig(num_blocks=-(-max_tokens // BLOCK_SIZE) + 8, block_size=BLOCK_SIZE, max_num_batched_tokens=max_tokens,
                          chunk_size=max_tokens, enable_prefix_caching=False)
    engine = Engine(model, config, frozenset(), max_tokens + 16)
    server = KVServer("127.0.0.1", block_size=BLOCK_SIZE)
    rng = random.Random(0)
    conn.send(engine.kv_spec)
    while (msg := conn.recv()) is not None:
        num_tokens, mode = msg
        transfer_id = f"{mode}-{num_tokens}-{rng.random()}"
        seq = Sequence(transfer_id, [rng.randrange(1000, 30000) for _ in range(num_tokens)], num_tokens,
                       SamplingParams(max_tokens=2, ignore_eos=True), stop_after_first_token=True)
        if mode == "layerwise":
            seq.kv_progress = LayerProgress(engine.kv_spec.num_layers, num_tokens)
            source = StreamedKVSource(engine.kv_cache, seq, engine.free_blocks, seq.kv_progress)
            conn.send(server.put(transfer_id, source, 600))
        engine.add(seq)
        start = time.perf_counter()
        while engine.scheduler.has_work():
            engine.step()
        compute_s = time.perf_counter() - start
        if mode == "layerwise":
            if not source.own():
                engine.free_blocks(seq.block_table)
        else:
            conn.send(server.put(transfer_id, PagedKVSource(engine.kv_cache, seq.block_table, num_tokens, engine.free_blocks), 600))
        conn.send(compute_s)
    server.close()


def measure(model_name: str, dtype: str, lengths: list[int], repeats: int) -> list[dict]:
    """Per length: serial and layerwise seconds (request -> KV in the receiver's blocks),
    the serial transfer's own seconds, and the fraction hidden."""
    from kv_transfer.client import KVClient
    from kv_transfer.paged import PagedKVSink
    from pdserve.engine.allocator import keep_freed_memory
    from pdserve.engine.block_manager import BlockManager
    from pdserve.engine.kv_cache import PagedKVCache

    torch.set_num_threads(1)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_prefill_process, args=(child, model_name, dtype, max(lengths)), daemon=True)
    proc.start()
    rows = []
    try:
        spec = parent.recv()
        num_blocks = -(-max(lengths) // BLOCK_SIZE) + 8
        keep_freed_memory()  # as in a decode worker, whose engine sets it (the prefill side's Engine does)
        cache, manager, client = PagedKVCache(spec, num_blocks, BLOCK_SIZE), BlockManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=False), KVClient("grpc")
        for num_tokens in lengths:
            runs: dict[str, list[dict]] = {"serial": [], "layerwise": []}
            for _ in range(repeats + 1):  # the first round warms both paths up and is dropped
                for mode in ("serial", "layerwise"):
                    blocks = manager.allocate_blocks(manager.num_blocks_for(num_tokens))
                    sink = PagedKVSink(cache, blocks, num_tokens)
                    start = time.perf_counter()
                    parent.send((num_tokens, mode))
                    handle = parent.recv()
                    handed = time.perf_counter()
                    client.fetch(handle, sink, timeout_s=600)
                    done = time.perf_counter()
                    compute_s = parent.recv()
                    manager.free_blocks(blocks)
                    assert sink.first_token is not None or mode == "serial"
                    runs[mode].append({"total_s": done - start, "fetch_s": done - handed, "compute_s": compute_s})
            best = {mode: min(r[1:], key=lambda x: x["total_s"]) for mode, r in runs.items()}
            serial, layerwise = best["serial"], best["layerwise"]
            rows.append({
                "tokens": num_tokens, "bytes": num_tokens * spec.bytes_per_token,
                "serial_s": serial["total_s"], "serial_transfer_s": serial["fetch_s"], "serial_compute_s": serial["compute_s"],
                "layerwise_s": layerwise["total_s"], "layerwise_compute_s": layerwise["compute_s"],
                "layerwise_tail_s": layerwise["total_s"] - layerwise["compute_s"],
                "hidden_fraction": 1 - (layerwise["total_s"] - layerwise["compute_s"]) / serial["fetch_s"],
                "compute_ratio": layerwise["compute_s"] / serial["compute_s"],
            })
            print(f"overlap {num_tokens} tokens: serial = prefill {serial['compute_s'] * 1e3:.0f} ms + transfer {serial['fetch_s'] * 1e3:.1f} ms; "
                  f"layerwise = prefill {layerwise['compute_s'] * 1e3:.0f} ms + tail {rows[-1]['layerwise_tail_s'] * 1e3:.1f} ms: "
                  f"{rows[-1]['hidden_fraction']:.0%} of the transfer hidden", flush=True)
        client.close()
    finally:
        parent.send(None)
        proc.join(timeout=60)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--lengths", default="512,2048")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    print(json.dumps(measure(args.model, args.dtype, [int(n) for n in args.lengths.split(",")], args.repeats), indent=2))


if __name__ == "__main__":
    main()
