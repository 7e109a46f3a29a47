"""PagedModelRunner: packs one step's new tokens into a single transformers forward.

All scheduled sequences go through one forward as a packed batch
``input_ids: [1, num_new_tokens]`` with per-token ``position_ids`` (no padding);
attention reads each sequence's context from the paged pool.
"""

from __future__ import annotations

import logging

import torch

from pdserve.engine import paged_decode, paged_prefill
from pdserve.engine.attention import ATTN_IMPLEMENTATION, AttentionContext, set_context
from pdserve.engine.cuda_graphs import DecodeGraphs, GraphCaptureFailed
from pdserve.engine.kv_cache import PagedKVCache
from pdserve.engine.sequence import Sequence

logger = logging.getLogger(__name__)


class PagedModelRunner:
    def __init__(self, model, kv_cache: PagedKVCache, decode_kernel: bool | None = None, graphs: DecodeGraphs | None = None,
                 prefill_kernel: bool | None = None):
        """``decode_kernel``: None = on where it runs (CPU, bf16 or float32); ``prefill_kernel``:
        None or True = on where it runs (bf16, AVX512-BF16), False = torch SDPA; ``graphs``: run the
        decode steps they can take from CUDA graphs (cuda_graphs.py)."""
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        self.model = model
        self.kv_cache = kv_cache
        self.device = next(model.parameters()).device
        # decode attention in place over the blocks (C kernel) where it runs; else gather + SDPA
        self.decode_kernel = decode_kernel is not False and paged_decode.supports(kv_cache.spec.dtype, self.device)
        self.prefill_kernel = prefill_kernel is not False and paged_prefill.supports(kv_cache.spec.dtype, self.device, kv_cache.spec.head_dim)
        for name, asked, on in (("decode_kernel", decode_kernel, self.decode_kernel), ("prefill_kernel", prefill_kernel, self.prefill_kernel)):
            if asked is True and not on:  # true means "where it runs": say so when it does not
                logger.warning("pdserve: %s is true but it cannot run here (%s on %s); using torch SDPA",
                               name, kv_cache.spec.dtype, self.device)
        self.graphs = graphs

    def _context(self, batch: list[tuple[Sequence, int]]) -> tuple[AttentionContext, list[int], list[int]]:
        input_ids, positions, new_slots, context_slots, query_starts, context_lens, prompt_lens = [], [], [], [], [0], [], []
        decode_only = all(num_new == 1 for _, num_new in batch)
        for seq, num_new in batch:
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots = self.kv_cache.slots(seq.block_table, start if decode_only else 0, end)
            new_slots.append(slots[-num_new:])
            if not decode_only:
                context_slots.append(slots)  # [end]
                prompt_lens.append(max(seq.num_prompt_tokens, end))  # a recompute's prompt includes its generated tokens
            query_starts.append(query_starts[-1] + num_new)
            context_lens.append(end)
        ctx = AttentionContext(self.kv_cache, torch.cat(new_slots), query_starts, context_lens, context_slots,
                               prefill_kernel=self.prefill_kernel, prompt_lens=prompt_lens or None)
        # tokens the reference computes alone: generated ones, and a one-token prompt
        gemv_rows = [query_starts[i] for i, (seq, n) in enumerate(batch)
                     if n == 1 and (seq.num_computed_tokens >= seq.num_prompt_tokens or seq.num_prompt_tokens == 1)]
        ctx.gemv_rows = torch.tensor(gemv_rows, dtype=torch.long) if gemv_rows else None
        ctx.kv_progress = [(seq.kv_progress, min(seq.num_computed_tokens + n, seq.num_prompt_tokens))
                           for seq, n in batch if seq.kv_progress is not None] or None
        if decode_only:
            bs = self.kv_cache.block_size
            max_blocks = max(-(-n // bs) for n in context_lens)
            tables = [seq.block_table[:max_blocks] + [0] * (max_blocks - min(len(seq.block_table), max_blocks)) for seq, _ in batch]
            if self.decode_kernel:  # attention reads the blocks in place
                ctx.decode_block_tables = torch.tensor(tables, dtype=torch.int32)  # [B, max_blocks]
                ctx.decode_context_lens = torch.tensor(context_lens, dtype=torch.int32)  # [B]
            else:  # block-granular gather into a padded batch
                ctx.decode_block_ids = torch.tensor(tables, dtype=torch.long, device=self.device).view(-1)  # [B * max_blocks]
                if len(batch) > 1:  # one sequence attends over exactly its context, unmasked
                    lens = torch.tensor(context_lens, device=self.device)
                    ctx.decode_mask = torch.arange(max_blocks * bs, device=self.device)[None, :] < lens[:, None]  # [B, S]
        return ctx, input_ids, positions

    @torch.inference_mode()
    def forward(self, batch: list[tuple[Sequence, int]]) -> torch.Tensor:
        """Run one step; returns logits [len(batch), vocab] (float32, on the CPU, where
        sampling runs) at each sequence's last new token."""
        if self.graphs is not None and self.graphs.can_run(batch):
            try:
                return self.graphs.forward(batch)
            except GraphCaptureFailed:  # logged; this and every later step run eagerly
                pass
        ctx, input_ids, positions = self._context(batch)
        last_token_index = torch.tensor(ctx.query_starts[1:], device=self.device) - 1  # [num_seqs]
        set_context(ctx)
        try:
            out = self.model(
                input_ids=torch.tensor([input_ids], device=self.device),
                position_ids=torch.tensor([positions], device=self.device),
                use_cache=False,
                logits_to_keep=last_token_index,
            )
        finally:
            set_context(None)
        return out.logits[0].float().cpu()
