"""A tensor-parallel rank's model (any rank, rank 0 included): its share of the weights
(shard.py) and its heads' view of the one shared KV pool, the collectives wired in after the
row-parallel projections, the vocabulary-parallel embedding and LM head; and a step's
metadata as bytes for ranks 1 .. n-1 (group.py sends it, rank.py runs it)."""

from __future__ import annotations

import dataclasses
import pickle

import torch

from pdserve.engine import backends
from pdserve.engine.backends.base import StepMetadata
from pdserve.engine.kv_cache import PagedKVCache, PoolMemory
from pdserve.engine.tensor_parallel.comm import ShmComm
from pdserve.engine.tensor_parallel.shard import ShardedCheckpoint, kv_head_range, vocab_ranges
from pdserve.kv_layout import KVSpec


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


def pack_meta(meta: StepMetadata) -> bytes:
    """A step's metadata as bytes for the other ranks: tensors as numpy arrays (a tenth of
    pickling torch tensors), layer-wise streaming's progress left out (rank 0 marks it)."""
    fields = {f.name: getattr(meta, f.name) for f in dataclasses.fields(meta) if f.name != "kv_progress"}
    fields = {k: ("t", v.numpy()) if isinstance(v, torch.Tensor) else ("v", v) for k, v in fields.items()}
    return pickle.dumps(fields, protocol=pickle.HIGHEST_PROTOCOL)


def unpack_meta(data: bytes) -> StepMetadata:
    fields = pickle.loads(data)
    return StepMetadata(**{k: torch.from_numpy(v) if kind == "t" else v for k, (kind, v) in fields.items()})
