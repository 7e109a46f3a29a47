"""The all-reduce of two tensor-parallel ranks: pdserve's shared-memory one (comm.py,
cpu/tp_comm.c) against torch.distributed's gloo, the other CPU choice, in the same run:
``python -m bench.collectives``. Writes bench/out/collectives.json.

Two processes, one thread each, as two ranks of a replica. Per size (elements of the
machine's default dtype; 512 is a decode row of bench/tensor_parallel.py's model, 131,072 a
256-token prefill's row block): the median of ``--iters`` all-reduces after a warm-up, as
seen by rank 0. gloo sums in float32 where pdserve sums bf16 in float32 and rounds once, so
its bits may differ; this measures time only.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import socket
import time
import uuid
from pathlib import Path

import torch

from bench import hardware

SIZES = (512, 8192, 131072, 1048576)


def _shm(rank: int, path: str, dtype: torch.dtype, iters: int, out) -> None:
    from pdserve.engine.tensor_parallel.comm import ShmComm

    torch.set_num_threads(1)
    comm = ShmComm(path, rank, 2, max(SIZES) * dtype.itemsize, dtype, create=False)
    times = {}
    for n in SIZES:
        x = torch.randn(n).to(dtype)
        for _ in range(10):
            comm.all_reduce_(x)
        t = []
        for _ in range(iters):
            start = time.perf_counter()
            comm.all_reduce_(x)
            t.append(time.perf_counter() - start)
        times[n] = statistics.median(t)
    if rank == 0:
        out.put(times)


def _gloo(rank: int, port: int, dtype: torch.dtype, iters: int, out) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    times = {}
    for n in SIZES:
        x = torch.randn(n).to(dtype)
        for _ in range(10):
            dist.all_reduce(x)
        t = []
        for _ in range(iters):
            start = time.perf_counter()
            dist.all_reduce(x)
            t.append(time.perf_counter() - start)
        times[n] = statistics.median(t)
    dist.destroy_process_group()
    if rank == 0:
        out.put(times)


def _run(target, arg, dtype: torch.dtype, iters: int) -> dict[int, float]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, arg, dtype, iters, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    times = out.get(timeout=600)
    for p in procs:
        p.join(60)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--out", default="bench/out/collectives.json")
    args = parser.parse_args()
    from pdserve.engine.tensor_parallel.comm import ShmComm

    dtype = getattr(torch, args.dtype)
    path = os.path.join("/dev/shm", f"pdserve-tp-bench-{uuid.uuid4().hex[:8]}")
    ShmComm(path, 0, 2, max(SIZES) * dtype.itemsize, dtype, create=True)  # made and zeroed once; both ranks map it
    try:
        shm = _run(_shm, path, dtype, args.iters)
    finally:
        os.unlink(path)
    with socket.socket() as s:  # a free port for gloo's rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    gloo = _run(_gloo, port, dtype, args.iters)
    rows = [{"elements": n, "shm_us": shm[n] * 1e6, "gloo_us": gloo[n] * 1e6, "gloo_over_shm": gloo[n] / shm[n]} for n in SIZES]
    for r in rows:
        print(f"{r['elements']:8d} elements: shm {r['shm_us']:8.1f} us  gloo {r['gloo_us']:8.1f} us  ({r['gloo_over_shm']:.1f}x)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), **hardware.describe(), "dtype": args.dtype, "rows": rows},
                                         indent=1) + "\n")


if __name__ == "__main__":
    main()
