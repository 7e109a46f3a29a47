"""DecodeGraphs: decode steps on a GPU replayed from CUDA graphs.

A decode step of the bundled model is ~30 layers x ~15 kernels. At small batch, the GPU
finishes each kernel before Python has launched the next one, so the step costs what
launching costs. A CUDA graph records the whole forward once and replays it with one
launch. vLLM and SGLang do the same for decode.

A graph fixes every shape and address, so:

- the step's inputs are copied into static tensors owned by the graph;
- the batch is padded up to a bucket of 1, 2, 4, 8, then multiples of 8 up to ``max_num_seqs``;
- every block table is padded to a bucket of 1, 2, 4, ... blocks, up to ``max_model_len``.

One graph is captured per (batch bucket, block bucket), the first time a step needs it,
and all graphs share one memory pool. A padding row is token 0 at position 0. It writes
its K/V into the scratch block, the pool's last block, which the block manager never
hands out, and it attends to that one slot. Attention is the gathered path (blocks gathered
into a padded batch, torch SDPA under a mask), gathering into buffers that live as long
as the graphs.

With ``capture=False`` the same padded static-shape step runs eagerly. The CPU tests use
this to check the padding against the reference.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass

import torch

from pdserve.engine.backends.base import StepMetadata
from pdserve.engine.kv_cache import PagedKVCache
from pdserve.engine.sequence import Sequence

log = logging.getLogger(__name__)


class GraphCaptureFailed(RuntimeError):
    """Capture failed; the step should run eagerly (``can_run`` is False from now on)."""


def batch_buckets(max_num_seqs: int) -> list[int]:
    """Padded batch sizes: 1, 2, 4, 8, then multiples of 8, the last >= ``max_num_seqs``."""
    sizes = [1, 2, 4, 8]
    while sizes[-1] < max_num_seqs:
        sizes.append(sizes[-1] + 8)
    return sizes


def block_buckets(max_blocks: int) -> list[int]:
    """Padded block-table lengths: powers of two below ``max_blocks``, then ``max_blocks``."""
    sizes = [1]
    while sizes[-1] < max_blocks:
        sizes.append(min(2 * sizes[-1], max_blocks))
    return sizes


@dataclass
class _StaticStep:
    """One captured shape: ``num_seqs`` rows, block tables of ``num_blocks`` blocks. Its
    metadata's tensors are the graph's inputs, refilled in place every step."""

    meta: StepMetadata
    graph: object | None = None  # torch.cuda.CUDAGraph once captured
    logits: torch.Tensor | None = None  # [num_seqs, vocab] the graph's output


class DecodeGraphs:
    def __init__(self, model, kv_cache: PagedKVCache, scratch_block: int, max_num_seqs: int, max_model_len: int, capture: bool = True):
        """``scratch_block``: a block of ``kv_cache`` no sequence is ever given (padding rows
        write there). ``capture``: record CUDA graphs (the pool must be on a CUDA device);
        False runs the padded static-shape step eagerly."""
        self.model = model
        self.kv_cache = kv_cache
        self.scratch_block = scratch_block
        self.capture = capture
        self.device = kv_cache.device
        self.batch_sizes = batch_buckets(max_num_seqs)
        self.block_counts = block_buckets(min(-(-max_model_len // kv_cache.block_size), scratch_block))
        self.steps: dict[tuple[int, int], _StaticStep] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.workspaces: dict[str, torch.Tensor] = {}  # gather buffers, sized once for the largest shape
        self.failed: str | None = None  # why capture failed; then every step runs eagerly

    def can_run(self, batch: list[tuple[Sequence, int]]) -> bool:
        """A decode-only step that fits the largest bucket, with no layer-wise KV stream."""
        return (
            self.failed is None
            and len(batch) <= self.batch_sizes[-1]
            and all(n == 1 and seq.kv_progress is None for seq, n in batch)
            and max(seq.num_computed_tokens + 1 for seq, _ in batch) <= self.block_counts[-1] * self.kv_cache.block_size
        )

    def forward(self, batch: list[tuple[Sequence, int]]) -> torch.Tensor:
        """Run one decode step; returns logits [len(batch), vocab] (float32, on the CPU)."""
        bs = self.kv_cache.block_size
        context_lens = [seq.num_computed_tokens + 1 for seq, _ in batch]
        num_seqs = self.batch_sizes[bisect.bisect_left(self.batch_sizes, len(batch))]
        num_blocks = self.block_counts[bisect.bisect_left(self.block_counts, -(-max(context_lens) // bs))]
        step = self.steps.get((num_seqs, num_blocks))
        if step is None:
            try:
                step = self._new_step(num_seqs, num_blocks)
            except Exception as e:  # a forward that cannot be captured: eager from now on
                log.warning("CUDA graph capture failed (%s: %s); decode steps run eagerly", type(e).__name__, e)
                self.failed = f"{type(e).__name__}: {e}"
                raise GraphCaptureFailed(self.failed) from e
        # padding rows (past len(batch)): token 0 at position 0, into and over the scratch slot
        input_ids, positions, slots, tables = [0] * num_seqs, [0] * num_seqs, [self.scratch_block * bs] * num_seqs, []
        for i, ((seq, _), context_len) in enumerate(zip(batch, context_lens)):
            pos = context_len - 1
            input_ids[i], positions[i] = seq.token_ids[pos], pos
            slots[i] = seq.block_table[pos // bs] * bs + pos % bs
            table = seq.block_table[: -(-context_len // bs)]
            tables.append(table + [self.scratch_block] * (num_blocks - len(table)))
        tables += [[self.scratch_block] * num_blocks] * (num_seqs - len(batch))
        lens = context_lens + [1] * (num_seqs - len(batch))
        m = step.meta
        m.input_ids.copy_(torch.tensor(input_ids))
        m.positions.copy_(torch.tensor(positions))
        m.slot_mapping.copy_(torch.tensor(slots))
        m.block_tables.copy_(torch.tensor(tables, dtype=torch.int32))
        m.extra["block_ids"].copy_(m.block_tables.view(-1))
        m.extra["mask"].copy_(torch.arange(num_blocks * bs)[None, :] < torch.tensor(lens)[:, None])
        m.context_lens[:] = lens  # read by the CPU backends' eager steps (a graph reads tensors only)
        if step.graph is not None:
            step.graph.replay()
            logits = step.logits
        else:
            logits = self._run(step)
        return logits[: len(batch)].float().cpu()

    def _new_step(self, num_seqs: int, num_blocks: int) -> _StaticStep:
        bs, dev = self.kv_cache.block_size, self.device
        block_tables = torch.full((num_seqs, num_blocks), self.scratch_block, dtype=torch.int32, device=dev)
        mask = torch.zeros(num_seqs, num_blocks * bs, dtype=torch.bool, device=dev)
        mask[:, 0] = True
        rows = torch.arange(num_seqs, device=dev)
        meta = StepMetadata(
            input_ids=torch.zeros(num_seqs, dtype=torch.long, device=dev), positions=torch.zeros(num_seqs, dtype=torch.long, device=dev),
            slot_mapping=torch.full((num_seqs,), self.scratch_block * bs, dtype=torch.long, device=dev),
            token_seq=rows.to(torch.int32), block_tables=block_tables, query_starts=list(range(num_seqs + 1)),
            context_lens=[1] * num_seqs, last_token_index=rows, decode_only=True,
            extra={"block_ids": block_tables.long().view(-1), "mask": mask, "workspaces": self.workspaces})
        step = _StaticStep(meta)
        if not self.workspaces:  # size the gather buffers for the largest shape now: a graph keeps their address
            spec = self.kv_cache.spec
            num_bytes = spec.num_kv_heads * self.batch_sizes[-1] * self.block_counts[-1] * bs * spec.head_dim * spec.dtype.itemsize
            for name in ("k", "v"):  # as 32-bit words, the unit gather_blocks copies in
                self.workspaces[name] = torch.empty(num_bytes // 4, dtype=torch.float32, device=dev)
        if self.capture:
            self._capture(step)
        self.steps[(num_seqs, num_blocks)] = step
        return step

    def _run(self, step: _StaticStep) -> torch.Tensor:
        return self.model.forward(step.meta)  # [num_seqs, vocab]

    def _capture(self, step: _StaticStep) -> None:
        # warm up on a side stream (lazy initialisation must not be recorded), then record;
        # the static inputs hold padding rows here, which write only the scratch block
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._run(step)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        step.graph = torch.cuda.CUDAGraph()
        # thread_local: KV transfers keep writing into the pool from other threads meanwhile
        with torch.cuda.graph(step.graph, pool=self.pool, capture_error_mode="thread_local"):
            step.logits = self._run(step)
