"""TPGroup: an engine's tensor-parallel ranks on one node. Rank 0 is the engine's own process
(scheduler, sampler, KV hand-off); ranks 1 .. n-1 are Ray actors in the replica's placement
group, or child processes outside Ray (launch.py). Each holds a share of the weights
(shard.py) and runs the same forward on every step.

    rank 0                                 rank r > 0 (rank.py worker_main)
    meta = backend.prepare(batch)
    send meta to every rank  ───────────►  meta = recv()
    model.forward(meta)                    model.forward(meta)
       all-reduce after o_proj, down  ◄──►    the same collectives (comm.py)
       logits: gather vocab columns   ◄───    its columns
    sample (rank 0 only)

The KV pool is one shared-memory file of all KV heads (engine/kv_cache.py SharedPoolMemory).
Each rank's attention stores and reads only its own heads, through a view; rank 0's engine
sees the whole pool, so the KV hand-off, block copies and checksums see whole heads, the
same bytes as at any other tensor-parallel size. A prefill at TP=p hands off to a decode at
TP=d for any p and d without a layout of its own.

A rank that dies is seen at once: rank 0 waits on each rank in a thread and aborts the
collectives (comm.py ``abort``), so a step in flight raises instead of waiting out
TIMEOUT_S, and ``check`` names the rank for the health check. A rank whose rank 0 is gone
aborts them too and exits.
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
import uuid

from pdserve.engine.kv_cache import PagedKVCache
from pdserve.engine.tensor_parallel import launch
from pdserve.engine.tensor_parallel.comm import ShmComm
from pdserve.engine.tensor_parallel.rank_model import RankPlan, build_rank, comm_capacity, pack_meta
from pdserve.engine.tensor_parallel.shard import ShardedCheckpoint

log = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0  # longest rank 0 waits for a rank to load its share


class TPGroup:
    def __init__(self, plan: RankPlan, comm: ShmComm):
        """Start ranks 1 .. world-1 (launch.py: actors in the placement group rank 0 runs in,
        else child processes) and wait until each has loaded its share. Raises RuntimeError
        naming the rank that failed, TimeoutError."""
        self.plan, self.comm = plan, comm
        self._lock = threading.Lock()  # check() from the engine, event-loop and health-check threads
        self._closing = False
        self.ranks: list = []
        data = pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            pg = launch.current_placement_group(plan.world)
            if pg is not None:
                self.ranks = launch.start_actors(pg, plan.world, START_TIMEOUT_S)
            else:
                for rank in range(1, plan.world):
                    self.ranks.append(launch.ChildRank(rank))
            for r in self.ranks:
                r.conn.send_bytes(data)
            for rank, r in enumerate(self.ranks, 1):
                if not r.conn.poll(START_TIMEOUT_S):
                    raise TimeoutError(f"tensor parallel rank {rank} did not load in {START_TIMEOUT_S:.0f} s")
                try:
                    what, detail = r.conn.recv()
                except (EOFError, OSError):
                    what, detail = "error", f"its connection closed ({r.exited() or 'no exit seen yet'})"
                if what != "ready":
                    raise RuntimeError(f"tensor parallel rank {rank} failed to start: {detail}")
                r.pid = detail
        except BaseException:
            self.close()
            raise
        log.info("tensor parallel: %d ranks, %s (pids %s)", plan.world, "Ray actors in the placement group" if pg is not None else
                 "child processes", [r.pid for r in self.ranks])
        for rank, r in enumerate(self.ranks, 1):
            threading.Thread(target=self._watch, args=(rank, r), name=f"tp-watch-rank{rank}", daemon=True).start()

    def _watch(self, rank: int, r) -> None:
        """A rank that ends before close() aborts every rank's collectives."""
        how = r.wait()
        if not self._closing:
            log.error("tensor parallel rank %d (pid %s) %s", rank, r.pid, how)
            self.comm.abort()

    def broadcast(self, meta) -> None:
        """Send one step's metadata to ranks 1 .. n-1 (before rank 0 runs it). Raises
        RuntimeError where a rank is gone."""
        self.check()
        data = pack_meta(meta)
        for rank, r in enumerate(self.ranks, 1):
            try:
                r.conn.send_bytes(data)
            except OSError as e:
                raise RuntimeError(f"tensor parallel rank {rank} is gone: {e}") from e

    def check(self) -> None:
        """Raises RuntimeError if a rank died or reported an error (any thread may ask)."""
        with self._lock:
            self._check()

    def _check(self) -> None:
        if self._closing:
            raise RuntimeError("tensor parallel group is closed")
        for rank, r in enumerate(self.ranks, 1):
            closed = False
            if r.conn.poll():  # its own error first: it sends it before it ends
                try:
                    _, detail = r.conn.recv()
                    raise RuntimeError(f"tensor parallel rank {rank} (pid {r.pid}): {detail}")
                except (EOFError, OSError):
                    closed = True
            if (how := r.exited()) is not None:
                raise RuntimeError(f"tensor parallel rank {rank} (pid {r.pid}) {how}")
            if closed:
                raise RuntimeError(f"tensor parallel rank {rank} (pid {r.pid}): its connection closed")

    def close(self) -> None:
        """Stop the ranks (each within 10 s, else killed). A check() after it raises."""
        with self._lock:
            self._closing = True
            ranks, self.ranks = self.ranks, []
        for r in ranks:
            try:
                r.conn.send_bytes(b"close")
            except OSError:
                pass
        for r in ranks:
            r.stop(10)
            r.conn.close()


def start(checkpoint, kv_cache: PagedKVCache, world: int, backend: str, num_threads: int, max_positions: int, max_tokens: int,
          max_seqs: int):
    """Rank 0's side for an engine whose pool ``kv_cache`` lives in a shared file: the comm
    segment, ranks 1 .. world-1 started, and rank 0's own model. Returns (group, model).
    Raises UnsupportedModelError, RuntimeError, TimeoutError, OSError."""
    ShardedCheckpoint(checkpoint, 0, world)  # refuses an unsplittable model before anything starts
    cap = comm_capacity(checkpoint.config, checkpoint.dtype, max_tokens, max_seqs, world)
    path = f"/dev/shm/pdserve-tp-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    comm = ShmComm(path, 0, world, cap, checkpoint.dtype, create=True)
    plan = RankPlan(checkpoint, world, kv_cache.shm_path, kv_cache.spec, kv_cache.num_blocks, kv_cache.block_size, path, cap, backend,
                    num_threads, max_positions)
    try:
        group = TPGroup(plan, comm)
    finally:
        comm.unlink()  # every rank has mapped it (or failed)
    try:
        model = build_rank(plan, 0, comm, (kv_cache.k, kv_cache.v))
    except BaseException:
        group.close()
        raise
    return group, model

