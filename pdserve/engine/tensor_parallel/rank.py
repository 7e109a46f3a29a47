"""A tensor-parallel rank > 0: worker_main, run by a Ray actor (launch.py TPRankActor) or in
a child process forked by rank 0's forkserver (forkserver.py), on one end of a socket pair."""

from __future__ import annotations

import logging
import os
import pickle
import threading
import time

import torch

from pdserve.engine.allocator import keep_freed_memory
from pdserve.engine.kv_cache import map_pool_file
from pdserve.engine.tensor_parallel.comm import ShmComm
from pdserve.engine.tensor_parallel.rank_model import build_rank, unpack_meta

log = logging.getLogger(__name__)


def worker_main(conn, rank: int, rank0_pid: int | None = None) -> str | None:
    """A rank > 0: read its plan, build its share, say "ready", then run every step rank 0
    sends until it says "close" or its pipe ends. ``rank0_pid``: rank 0's process where it is
    not this one's parent (an actor); a rank 0 that is gone aborts the collectives. Returns
    the error that ended it (also sent to rank 0), or None."""
    try:
        plan = pickle.loads(conn.recv_bytes())
        torch.set_num_threads(plan.num_threads)
        keep_freed_memory()  # as rank 0's engine: a step's buffers reused, not mapped and faulted in anew
        comm = ShmComm(plan.comm_path, rank, plan.world, plan.comm_cap, plan.checkpoint.dtype)
        pool = map_pool_file(plan.pool_path, plan.spec, plan.num_blocks, plan.block_size)
        model = build_rank(plan, rank, comm, pool)
    except Exception as e:  # noqa: BLE001 - reported to rank 0, which raises it
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return f"{type(e).__name__}: {e}"
    conn.send(("ready", os.getpid()))
    parent = os.getppid()

    def watch_parent() -> None:  # rank 0 gone mid-collective: end the wait now, not after TIMEOUT_S
        while os.getppid() == parent and (rank0_pid is None or pid_alive(rank0_pid)):
            time.sleep(0.5)
        comm.abort()

    threading.Thread(target=watch_parent, name=f"tp-rank{rank}-parent", daemon=True).start()
    while True:
        try:
            msg = conn.recv_bytes()
        except (EOFError, OSError):
            return
        if msg == b"close":
            return
        meta = unpack_meta(msg)
        try:
            with torch.inference_mode(), model.backend.step_scope():
                model.forward(meta)
        except Exception as e:  # noqa: BLE001
            log.error("tensor parallel rank %d: %s", rank, e)
            conn.send(("error", f"{type(e).__name__}: {e}"))
            return f"{type(e).__name__}: {e}"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

