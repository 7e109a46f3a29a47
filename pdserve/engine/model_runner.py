"""PagedModelRunner: packs one step's new tokens into a single transformers forward.

All scheduled sequences go through one forward as a packed batch
``input_ids: [1, num_new_tokens]`` with per-token ``position_ids`` (no padding);
attention reads each sequence's context from the paged pool.
"""

from __future__ import annotations

import torch

from pdserve.engine.attention import ATTN_IMPLEMENTATION, AttentionContext, set_context
from pdserve.engine.kv_cache import PagedKVCache
from pdserve.engine.sequence import Sequence


class PagedModelRunner:
    def __init__(self, model, kv_cache: PagedKVCache):
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        self.model = model
        self.kv_cache = kv_cache
        self.device = next(model.parameters()).device
        self.num_forwards = 0

    def _context(self, batch: list[tuple[Sequence, int]]) -> tuple[AttentionContext, list[int], list[int]]:
        input_ids, positions, new_slots, context_slots, query_starts, context_lens = [], [], [], [], [0], []
        for seq, num_new in batch:
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots = self.kv_cache.slots(seq.block_table, 0, end)  # [end]
            context_slots.append(slots)
            new_slots.append(slots[start:])
            query_starts.append(query_starts[-1] + num_new)
            context_lens.append(end)
        ctx = AttentionContext(self.kv_cache, torch.cat(new_slots), query_starts, context_lens, context_slots)
        if all(num_new == 1 for _, num_new in batch):
            max_len = max(context_lens)
            if len(batch) == 1 or min(context_lens) == max_len:
                ctx.decode_slots = torch.stack(context_slots)  # [B, max_len]
            else:
                ctx.decode_slots = torch.stack([torch.nn.functional.pad(s, (0, max_len - len(s))) for s in context_slots])
                lens = torch.tensor(context_lens)
                ctx.decode_mask = (torch.arange(max_len)[None, :] < lens[:, None]).view(len(batch), 1, 1, max_len)
        return ctx, input_ids, positions

    @torch.inference_mode()
    def forward(self, batch: list[tuple[Sequence, int]]) -> torch.Tensor:
        """Run one step; returns logits [len(batch), vocab] (float32) at each sequence's last new token."""
        ctx, input_ids, positions = self._context(batch)
        last_token_index = torch.tensor(ctx.query_starts[1:]) - 1  # [num_seqs]
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
        self.num_forwards += 1
        return out.logits[0].float()
