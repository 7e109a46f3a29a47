"""KV transfer benchmark: bytes/s and latency per backend for the bundled model's KV at
128 to 8,192 tokens, against memcpy bandwidth measured in the same run, and the share
of TTFT that the transfer takes for a 2,048-token prompt; then how much of the grpc
transfer layer-wise streaming hides behind prefill (bench/overlap.py); and the hand-off between
pools of each pair of tensor-parallel sizes (bench/transfer_tp.py).

Run: ``bash bench/run.sh transfer`` (or ``python -m bench.transfer --help``). Writes a
table to stdout, ``bench/out/transfer.json`` and ``bench/out/transfer.png``.

Limits measured in the same run: memcpy bandwidth, and grpcio's own streaming rate
between two processes on loopback (ready-made 1 MiB messages, nothing else done, the KV
channel's frame size), which bounds the grpc backend whatever it does around the transport.

The sender runs in its own process, as a prefill worker does: a KVServer holding KV in
paged blocks of a pool in shared memory (so it can serve both backends). The receiver
(this process) fetches into its own paged pool, as a decode worker does, through the
same KVClient, fingerprint handshake, checksums and acknowledgement as in serving.
A transfer's latency runs from the fetch call to the acknowledged return.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import tempfile
import time
from pathlib import Path

import torch

from bench import hardware
from bench.overlap import measure as measure_overlap
from bench.transfer_tp import measure_pairs, parse_pairs
from pdserve.engine.allocator import keep_freed_memory

BLOCK_SIZE = 16


def _serve(conn, spec_args, num_blocks: int, shm_path: str) -> None:
    """Sender process: fill the pool with random KV, then put transfers on request."""
    from kv_transfer.paged import PagedKVSource
    from kv_transfer.server import KVServer
    from kv_transfer.shm_backend import ShmPoolMemory
    from pdserve.engine.block_manager import BlockManager
    from pdserve.engine.kv_cache import PagedKVCache
    from pdserve.kv_layout import KVSpec

    torch.set_num_threads(1)
    keep_freed_memory()  # as in a worker, whose engine sets it
    spec = KVSpec(*spec_args[:3], getattr(torch, spec_args[3]))
    cache = PagedKVCache(spec, num_blocks, BLOCK_SIZE, memory=ShmPoolMemory(shm_path, spec, num_blocks, BLOCK_SIZE))
    cache.k.copy_(torch.randn(cache.k.shape).to(spec.dtype))
    cache.v.copy_(torch.randn(cache.v.shape).to(spec.dtype))
    manager = BlockManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=False)
    server = KVServer("127.0.0.1", backend="auto", block_size=BLOCK_SIZE, shm_path=shm_path, node_id="bench")
    conn.send(server.address)
    while True:
        msg = conn.recv()
        if msg is None:
            break
        transfer_id, num_tokens = msg
        blocks = manager.allocate_blocks(manager.num_blocks_for(num_tokens))
        conn.send(server.put(transfer_id, PagedKVSource(cache, blocks, num_tokens, manager.free_blocks), 60))
    server.close()
    cache.close()


def _raw_grpc_server(conn, message_bytes: int, num_messages: int) -> None:
    import grpc
    from concurrent import futures

    payload = b"x" * message_bytes

    def stream(request, context):
        for _ in range(num_messages):
            yield payload

    handler = grpc.method_handlers_generic_handler("bench.Raw", {"Stream": grpc.unary_stream_rpc_method_handler(
        stream, request_deserializer=bytes, response_serializer=bytes)})
    from kv_transfer.grpc_backend import FRAME_OPTIONS

    server = grpc.server(futures.ThreadPoolExecutor(2), options=[("grpc.max_send_message_length", 64 << 20), *FRAME_OPTIONS])
    server.add_generic_rpc_handlers((handler,))
    conn.send(server.add_insecure_port("127.0.0.1:0"))
    server.start()
    conn.recv()
    server.stop(None)


def raw_grpc_bandwidth(message_bytes: int = 1 << 20, total_bytes: int = 256 << 20) -> float:
    """Bytes/s of grpcio alone streaming ready-made messages between two processes on
    loopback: the transport's own ceiling here, for the grpc backend's ratio."""
    import grpc

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_raw_grpc_server, args=(child, message_bytes, total_bytes // message_bytes), daemon=True)
    proc.start()
    port = parent.recv()
    from kv_transfer.grpc_backend import FRAME_OPTIONS

    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_receive_message_length", 64 << 20), *FRAME_OPTIONS])
    call = channel.unary_stream("/bench.Raw/Stream", request_serializer=bytes, response_deserializer=bytes)
    best = 0.0
    for _ in range(3):
        start = time.perf_counter()
        received = sum(len(m) for m in call(b""))
        best = max(best, received / (time.perf_counter() - start))
    channel.close()
    parent.send(None)
    proc.join(timeout=10)
    return best


def kv_spec_of(model_name: str, dtype: str):
    from transformers import AutoConfig

    from pdserve.kv_layout import KVSpec
    from pdserve.model_loader import resolve_model_dir

    return KVSpec.from_model_config(AutoConfig.from_pretrained(resolve_model_dir(model_name)), getattr(torch, dtype))


def measure_transfers(spec, lengths: list[int], backends: list[str], repeats: int) -> list[dict]:
    from kv_transfer.client import KVClient
    from kv_transfer.paged import PagedKVSink
    from pdserve.engine.block_manager import BlockManager
    from pdserve.engine.kv_cache import PagedKVCache

    num_blocks = -(-max(lengths) // BLOCK_SIZE) * 2 + 8
    shm_path = os.path.join("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir(), f"pdserve-kv-bench-{os.getpid()}")
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_serve, args=(child, (spec.num_layers, spec.num_kv_heads, spec.head_dim, str(spec.dtype).removeprefix("torch.")), num_blocks, shm_path), daemon=True)
    proc.start()
    parent.recv()  # the server's address: it is up
    keep_freed_memory()  # as in a worker, whose engine sets it
    dst = PagedKVCache(spec, num_blocks, BLOCK_SIZE)
    manager = BlockManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=False)
    results, counter = [], 0
    try:
        for backend in backends:
            client = KVClient(backend, node_id="bench")
            for n in lengths:
                times = []
                for _ in range(repeats + 1):  # the first is a warm-up (connection, mapping, page faults)
                    counter += 1
                    parent.send((f"t{counter}", n))
                    handle = parent.recv()
                    blocks = manager.allocate_blocks(manager.num_blocks_for(n))
                    start = time.perf_counter()
                    used = client.fetch(handle, PagedKVSink(dst, blocks, n), timeout_s=120)
                    times.append(time.perf_counter() - start)
                    manager.free_blocks(blocks)
                    assert used == backend
                seconds = sorted(times[1:])[len(times[1:]) // 2]
                nbytes = n * spec.bytes_per_token
                results.append({"backend": backend, "tokens": n, "bytes": nbytes, "seconds": seconds, "bytes_per_s": nbytes / seconds})
                print(f"{backend:5s} {n:5d} tokens ({nbytes / 1e6:7.1f} MB): {seconds * 1e3:8.2f} ms  {nbytes / seconds / 1e9:6.2f} GB/s", flush=True)
            client.close()
    finally:
        parent.send(None)
        proc.join(timeout=30)
    return results


def prefill_seconds(model_name: str, dtype: str, num_tokens: int) -> float:
    """Seconds of the engine's prefill of one ``num_tokens`` prompt (the compute part of TTFT)."""
    from bench.engine import pdserve_prefill
    from pdserve.engine.engine import Engine, EngineConfig
    from pdserve.model_loader import load_model, resolve_model_dir

    model = load_model(resolve_model_dir(model_name), dtype)
    engine = Engine(model, EngineConfig(num_blocks=-(-num_tokens // 16) + 8, enable_prefix_caching=False), frozenset(), 8192)
    return pdserve_prefill(engine, num_tokens, repeats=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--lengths", default="128,512,2048,8192")
    parser.add_argument("--backends", default="grpc,shm")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ttft-tokens", type=int, default=2048)
    parser.add_argument("--tp-pairs", default="1:1,1:2,2:1,2:2",
                        help="prefill:decode tensor-parallel sizes whose hand-off is timed (bench/transfer_tp.py); '' skips")
    parser.add_argument("--out", default="bench/out")
    args = parser.parse_args()
    torch.set_num_threads(1)
    lengths = [int(n) for n in args.lengths.split(",")]
    backends = args.backends.split(",")

    memcpy = hardware.memcpy_bandwidth()
    raw_grpc = raw_grpc_bandwidth() if "grpc" in backends else None
    spec = kv_spec_of(args.model, args.dtype)
    print(f"memcpy {memcpy / 1e9:.2f} GB/s; grpcio alone {raw_grpc / 1e9 if raw_grpc else float('nan'):.2f} GB/s; "
          f"KV {spec.bytes_per_token} bytes/token ({args.model}, {args.dtype})", flush=True)
    transfers = measure_transfers(spec, lengths, backends, args.repeats)
    for r in transfers:
        r["fraction_of_memcpy"] = r["bytes_per_s"] / memcpy
        if r["backend"] == "grpc" and raw_grpc:
            r["fraction_of_raw_grpc"] = r["bytes_per_s"] / raw_grpc
    overlap = measure_overlap(args.model, args.dtype, sorted({512, args.ttft_tokens}), args.repeats) if "grpc" in backends else []
    tp_pairs = measure_pairs(parse_pairs(args.tp_pairs), backends, args.ttft_tokens, args.repeats, args.dtype) if args.tp_pairs else []
    prefill_s = prefill_seconds(args.model, args.dtype, args.ttft_tokens)
    ttft = {}
    for backend in backends:
        t = next((r["seconds"] for r in transfers if r["backend"] == backend and r["tokens"] == args.ttft_tokens), None)
        if t is not None:
            ttft[backend] = {"prefill_s": prefill_s, "transfer_s": t, "fraction_of_ttft": t / (prefill_s + t)}
    by = {(r["backend"], r["tokens"]): r for r in transfers}
    largest = max(lengths)
    targets = {
        "grpc_gb_per_s_at_largest": by[("grpc", largest)]["bytes_per_s"] / 1e9 if ("grpc", largest) in by else None,
        "grpc_fraction_of_raw_grpcio_at_largest": by[("grpc", largest)].get("fraction_of_raw_grpc") if ("grpc", largest) in by else None,
        "shm_fraction_of_memcpy_at_largest": by[("shm", largest)]["fraction_of_memcpy"] if ("shm", largest) in by else None,
        **{f"{b}_fraction_of_ttft_at_{args.ttft_tokens}": v["fraction_of_ttft"] for b, v in ttft.items()},
        **{f"layerwise_hidden_fraction_at_{r['tokens']}": r["hidden_fraction"] for r in overlap},
    }
    result = {"model": args.model, "dtype": args.dtype, "memcpy_bytes_per_s": memcpy, "raw_grpcio_bytes_per_s": raw_grpc,
              "kv_bytes_per_token": spec.bytes_per_token,
              "transfers": transfers, "ttft": ttft, "layerwise_overlap": overlap, "tensor_parallel_pairs": tp_pairs, "targets": targets}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "transfer.json").write_text(json.dumps(result, indent=2))
    plot(result, out / "transfer.png")
    print(f"\n{'backend':>7} | {'tokens':>6} | {'MB':>7} | {'ms':>8} | {'GB/s':>6} | {'of memcpy':>9}")
    for r in transfers:
        print(f"{r['backend']:>7} | {r['tokens']:>6} | {r['bytes'] / 1e6:>7.1f} | {r['seconds'] * 1e3:>8.2f} | "
              f"{r['bytes_per_s'] / 1e9:>6.2f} | {r['fraction_of_memcpy']:>9.0%}")
    for b, v in ttft.items():
        print(f"TTFT at {args.ttft_tokens} tokens, {b}: prefill {v['prefill_s'] * 1e3:.0f} ms + transfer {v['transfer_s'] * 1e3:.1f} ms "
              f"= {v['fraction_of_ttft']:.2%} on transfer")
    print("targets:", json.dumps({k: round(v, 4) if v is not None else None for k, v in targets.items()}))
    print(f"wrote {out / 'transfer.json'} and {out / 'transfer.png'}")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for backend in sorted({r["backend"] for r in result["transfers"]}):
        rows = [r for r in result["transfers"] if r["backend"] == backend]
        ax.plot([r["tokens"] for r in rows], [r["bytes_per_s"] / 1e9 for r in rows], "o-", label=backend)
    ax.axhline(result["memcpy_bytes_per_s"] / 1e9, color="k", linestyle=":", label="memcpy (same run)")
    ax.set(xscale="log", xlabel="prompt tokens", ylabel="GB/s", title=f"KV transfer, {result['model']} {result['dtype']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
