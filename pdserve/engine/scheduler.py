"""Scheduler: which sequences run in the next forward, and how many new tokens each.

Policy (one step):
1. Running sequences first, oldest first: one token each when decoding, a chunk
   of at most ``chunk_size`` when still prefilling. If the pool cannot hold a
   sequence's new tokens, the newest running sequence is preempted (its blocks
   freed; it recomputes later from its tokens) until it can.
2. Then waiting sequences, in arrival order, while the token budget
   (``max_num_batched_tokens``), ``max_num_seqs`` and free blocks allow. A new
   sequence first takes its cached prefix blocks.
"""

from __future__ import annotations

from collections import deque

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.sequence import Sequence, SeqStatus


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int, chunk_size: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunk_size = chunk_size
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        """Queue a sequence; one that already holds its KV (block table filled) joins the running batch."""
        if seq.block_table:
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
        else:
            seq.status = SeqStatus.WAITING
            self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[tuple[Sequence, int]]:
        """Returns [(sequence, num_new_tokens)] for the next forward."""
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Sequence, int]] = []
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING:  # preempted earlier in this loop
                continue
            num_new = min(seq.num_uncomputed_tokens, self.chunk_size, budget)
            while not self.block_manager.ensure_slots(seq, seq.num_computed_tokens + num_new):
                self.preempt(self.running[-1])
                if seq.status is not SeqStatus.RUNNING:
                    break
            if seq.status is SeqStatus.RUNNING:
                scheduled.append((seq, num_new))
                budget -= num_new
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not seq.block_table:
                self.block_manager.allocate_prefix(seq)
            num_new = min(seq.num_uncomputed_tokens, self.chunk_size, budget)
            if not self.block_manager.ensure_slots(seq, seq.num_computed_tokens + num_new):
                self.block_manager.free(seq)  # a waiting sequence holds no blocks (they stay cached)
                break
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            scheduled.append((seq, num_new))
            budget -= num_new
        return scheduled

    def preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks; it goes back to the head of the queue to recompute."""
        self.running.remove(seq)
        self._free(seq, "preempted (the prompt is recomputed later)")
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, free_blocks: bool = True) -> None:
        """Remove a sequence (finished or aborted); ``free_blocks=False`` hands its blocks to the caller."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED
        if free_blocks:
            self._free(seq, "the request ended or was aborted")

    def _free(self, seq: Sequence, reason: str) -> None:
        if seq.kv_progress is not None:  # KV being streamed out: stop its readers first
            seq.kv_progress.fail(reason)
        self.block_manager.free(seq)
