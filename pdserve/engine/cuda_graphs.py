"""DecodeGraphs: decode steps on a GPU replayed from CUDA graphs.

A decode step of the bundled model is ~30 layers x ~15 kernels. At small batch, the GPU
finishes each kernel before Python has launched the next one, so the step costs what
launching costs. A CUDA graph records the whole forward once and replays it with one
launch. vLLM and SGLang do the same for decode.

A graph fixes every shape and address, so:

- the step's inputs are copied into static tensors owned by the graph;
- the batch is padded up to a bucket of 1, 2, 4, 8, then multiples of 8 up to ``max_num_seqs``;
- every block table is padded to the blocks of ``max_model_len``: the kernel reads a row's
  own blocks only (its count is an input), so one width serves every context length.

One graph is captured per batch bucket, all at start-up (``capture_all``, its time
logged), and all graphs share one memory pool. Nothing is captured while serving. A
padding row is token 0 at position 0. It writes its K/V into the scratch block, the pool's
last block, which the block manager never hands out, and it attends to that one slot. Attention is the cuda backend's paged
FlexAttention: the graph records the step's block mask being built from the static block
tables, context lengths and positions, so every replay rebuilds it from the step's own. A
row's padded table entries are past its context and never listed: padding adds no reads.

With ``capture=False`` the same padded static-shape step runs eagerly. The CPU tests use
this to check the padding against the reference.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass

import torch

from pdserve.engine.backends.base import StepMetadata
from pdserve.engine.kv_cache import PagedKVCache
from pdserve.engine.sequence import Sequence

log = logging.getLogger(__name__)


def batch_buckets(max_num_seqs: int) -> list[int]:
    """Padded batch sizes: 1, 2, 4, 8, then multiples of 8, the last >= ``max_num_seqs``."""
    sizes = [1, 2, 4, 8]
    while sizes[-1] < max_num_seqs:
        sizes.append(sizes[-1] + 8)
    return sizes


@dataclass
class _StaticStep:
    """One captured shape: ``num_seqs`` rows, block tables of ``DecodeGraphs.max_blocks``
    blocks. Its metadata's tensors are the graph's inputs, refilled in place every step."""

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
        self.max_blocks = min(-(-max_model_len // kv_cache.block_size), scratch_block)  # every table's width
        self.steps: dict[int, _StaticStep] = {}  # batch bucket -> its step
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.failed: str | None = None  # why capture failed; then every step runs eagerly

    def capture_all(self) -> None:
        """Make every bucket's step (capturing its graph where ``capture``) and log the time.
        A failure is logged and leaves every decode step eager (``failed``)."""
        start = time.perf_counter()
        try:
            for num_seqs in self.batch_sizes:
                self.steps[num_seqs] = self._new_step(num_seqs)
        except Exception as e:  # a forward that cannot be captured: eager from now on
            log.warning("CUDA graph capture failed (%s: %s); decode steps run eagerly", type(e).__name__, e)
            self.failed = f"{type(e).__name__}: {e}"
            self.steps.clear()
            return
        log.info("%s %d decode steps (batch %d to %d, %d blocks each) in %.2f s", "captured" if self.capture else "prepared",
                 len(self.steps), self.batch_sizes[0], self.batch_sizes[-1], self.max_blocks, time.perf_counter() - start)

    def can_run(self, batch: list[tuple[Sequence, int]]) -> bool:
        """A decode-only step that fits the largest bucket, with no layer-wise KV stream,
        once ``capture_all`` succeeded."""
        return (
            self.failed is None
            and bool(self.steps)
            and len(batch) <= self.batch_sizes[-1]
            and all(n == 1 and seq.kv_progress is None for seq, n in batch)
            and max(seq.num_computed_tokens + 1 for seq, _ in batch) <= self.max_blocks * self.kv_cache.block_size
        )

    def forward(self, batch: list[tuple[Sequence, int]]) -> torch.Tensor:
        """Run one decode step; returns logits [len(batch), vocab] on the device (a view of
        the graph's output buffer: read it before the next step)."""
        bs, num_blocks = self.kv_cache.block_size, self.max_blocks
        context_lens = [seq.num_computed_tokens + 1 for seq, _ in batch]
        num_seqs = self.batch_sizes[bisect.bisect_left(self.batch_sizes, len(batch))]
        step = self.steps[num_seqs]  # (all made by capture_all)
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
        m.extra["context_lens"].copy_(torch.tensor(lens))
        m.context_lens[:] = lens  # read by the CPU backends' eager steps (a graph reads tensors only)
        if step.graph is not None:
            step.graph.replay()
            logits = step.logits
        else:
            logits = self._run(step)
        return logits[: len(batch)]

    def _new_step(self, num_seqs: int) -> _StaticStep:
        bs, dev = self.kv_cache.block_size, self.device
        block_tables = torch.full((num_seqs, self.max_blocks), self.scratch_block, dtype=torch.int32, device=dev)
        rows = torch.arange(num_seqs, device=dev)
        meta = StepMetadata(
            input_ids=torch.zeros(num_seqs, dtype=torch.long, device=dev), positions=torch.zeros(num_seqs, dtype=torch.long, device=dev),
            slot_mapping=torch.full((num_seqs,), self.scratch_block * bs, dtype=torch.long, device=dev),
            token_seq=rows.to(torch.int32), block_tables=block_tables, query_starts=list(range(num_seqs + 1)),
            context_lens=[1] * num_seqs, last_token_index=rows, decode_only=True,
            extra={"context_lens": torch.ones(num_seqs, dtype=torch.long, device=dev), "paged": {}})
        step = _StaticStep(meta)
        if self.capture:
            self._capture(step)
        return step

    def _run(self, step: _StaticStep) -> torch.Tensor:
        step.meta.extra["paged"] = {}  # the block masks: built in this run, from the static inputs
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
