"""TPGroup: an engine's tensor-parallel ranks on one node. Rank 0 is the engine's own process
(scheduler, sampler, KV hand-off); ranks 1 .. n-1 are Ray actors in the replica's placement
group, or child processes outside Ray (launch.py). Each holds a share of the weights
(shard.py) and runs the same forward on every step.

    rank 0                                 rank r > 0 (worker_main)
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

import dataclasses
import logging
import os
import pickle
import threading
import time
import uuid

import torch

from pdserve.engine import backends
from pdserve.engine.allocator import keep_freed_memory
from pdserve.engine.backends.base import StepMetadata
from pdserve.engine.kv_cache import PagedKVCache, PoolMemory, map_pool_file
from pdserve.engine.tensor_parallel import launch
from pdserve.engine.tensor_parallel.comm import ShmComm
from pdserve.engine.tensor_parallel.shard import ShardedCheckpoint, kv_head_range, vocab_ranges
from pdserve.kv_layout import KVSpec

log = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0  # longest rank 0 waits for a rank to load its share


class HeadsView(PoolMemory):
    """One rank's KV heads [lo, hi) of a pool mapped whole: views, no memory of its own."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, lo: int, hi: int):
        self.kv = k[:, lo:hi], v[:, lo:hi]

    def allocate(self, shape, dtype, device):
        if tuple(self.kv[0].shape) != tuple(shape):
            raise ValueError(f"a rank's KV view is {tuple(self.kv[0].shape)}, its spec wants {tuple(shape)}")
        return self.kv


def rank_kv_cache(pool_k: torch.Tensor, pool_v: torch.Tensor, spec: KVSpec, num_blocks: int, block_size: int, config, rank: int,
                  world: int) -> PagedKVCache:
    """Rank ``rank``'s view of the whole pool (its KV heads), as a PagedKVCache."""
    lo, hi = kv_head_range(config, rank, world)
    rank_spec = dataclasses.replace(spec, num_kv_heads=hi - lo)
    return PagedKVCache(rank_spec, num_blocks, block_size, pool_k.device, HeadsView(pool_k, pool_v, lo, hi))


def comm_capacity(config, dtype: torch.dtype, max_tokens: int, max_seqs: int, world: int) -> int:
    """Slot bytes for a step of ``max_tokens`` tokens and ``max_seqs`` sampled rows."""
    vocab = vocab_ranges(config.vocab_size, world)[0]
    return max(max_tokens * config.hidden_size * dtype.itemsize, max_seqs * (vocab[1] - vocab[0]) * 4, 64)


class VocabParallelEmbedding:
    """The rank's rows [lo, hi) of the table; ids outside them give zeros, and the all-reduce
    adds the one rank's row to zeros (exact)."""

    def __init__(self, inner, lo: int, hi: int, comm: ShmComm):
        self.inner, self.lo, self.hi, self.comm = inner, lo, hi, comm
        self.quantized = inner.quantized
        self.weight, self.blocks = inner.weight, getattr(inner, "blocks", None)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: [N] int64 -> [N, H]."""
        local = ids - self.lo
        inside = (local >= 0) & (local < self.hi - self.lo)
        h = self.inner(torch.where(inside, local, torch.zeros_like(local)))
        h = torch.where(inside[:, None], h, torch.zeros_like(h)).contiguous()
        return self.comm.all_reduce_(h)


def parallelize(model, comm: ShmComm, config, rank: int, world: int) -> None:
    """Turn ``model`` (built over a ShardedCheckpoint of rank ``rank``) into its rank of the
    group: the all-reduce after each row-parallel projection (o_proj, down; an MoE's sum over
    its experts), the vocabulary
    embedding's all-reduce, the LM head's gather (rank 0 gets every column), and the fused
    decoder rebuilt with the all-reduce inside."""
    widths = [hi - lo for lo, hi in vocab_ranges(config.vocab_size, world)]
    lo, hi = vocab_ranges(config.vocab_size, world)[rank]
    model.embed = VocabParallelEmbedding(model.embed, lo, hi, comm)
    backend = model.backend
    pending: list = []  # layer-wise streaming: a layer is marked stored once every rank stored it
    mark = backend.mark_stored

    def defer(layer, meta):
        pending.append((layer, meta))

    def reduce_o(y: torch.Tensor) -> torch.Tensor:
        comm.all_reduce_(y)  # every rank has stored this layer's KV before its o_proj
        while pending:
            mark(*pending.pop(0))
        return y

    backend.mark_stored = defer
    for layer in model.layers:
        layer.o_proj.after = reduce_o
        if getattr(layer, "is_moe", False):  # one all-reduce of the sum over experts, not one per expert
            layer.moe.after = comm.all_reduce_
        else:
            layer.down.after = comm.all_reduce_

    def gather(y: torch.Tensor) -> torch.Tensor:
        full = comm.gather_columns(y.float(), widths)
        return full.to(y.dtype) if full is not None else y

    model.lm_head.after = gather
    backend.allreduce_hook = comm.hook
    if getattr(model, "fused", None) is not None:
        model.fused = backend.fuse_layers(model.layers)


@dataclasses.dataclass
class RankPlan:
    """What a rank needs to build its share (picklable for a spawned process)."""

    checkpoint: object  # the whole Checkpoint (re-opened in the child)
    world: int
    pool_path: str
    spec: KVSpec
    num_blocks: int
    block_size: int
    comm_path: str
    comm_cap: int
    backend: str
    num_threads: int
    max_positions: int


def build_rank(plan: RankPlan, rank: int, comm: ShmComm, pool: tuple[torch.Tensor, torch.Tensor]):
    """Rank ``rank``'s model over its share of the weights and its view of the pool."""
    from pdserve.engine.models import build_model

    shard = ShardedCheckpoint(plan.checkpoint, rank, plan.world)
    kv = rank_kv_cache(*pool, plan.spec, plan.num_blocks, plan.block_size, plan.checkpoint.config, rank, plan.world)
    backend = backends.select(plan.backend, kv, plan.num_threads)
    model = build_model(shard, backend, plan.max_positions)
    parallelize(model, comm, plan.checkpoint.config, rank, plan.world)
    return model


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


def pack_meta(meta: StepMetadata) -> bytes:
    """A step's metadata as bytes for the other ranks: tensors as numpy arrays (a tenth of
    pickling torch tensors), layer-wise streaming's progress left out (rank 0 marks it)."""
    fields = {f.name: getattr(meta, f.name) for f in dataclasses.fields(meta) if f.name != "kv_progress"}
    fields = {k: ("t", v.numpy()) if isinstance(v, torch.Tensor) else ("v", v) for k, v in fields.items()}
    return pickle.dumps(fields, protocol=pickle.HIGHEST_PROTOCOL)


def unpack_meta(data: bytes) -> StepMetadata:
    fields = pickle.loads(data)
    return StepMetadata(**{k: torch.from_numpy(v) if kind == "t" else v for k, (kind, v) in fields.items()})


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

    @property
    def pids(self) -> list[int]:
        """Ranks 1 .. n-1's process ids."""
        return [r.pid for r in self.ranks]

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

