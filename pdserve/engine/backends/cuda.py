"""The ``cuda`` backend: the torch ops batched on a GPU, with attention CUDA graphs can hold.

Linear layers, norms, rotary and activation are the torch backend's formulas over the whole
step at once. Attention:

- prompt chunks: per sequence, its context gathered from the pool and one SDPA call (causal
  for a whole prompt, an offset mask for a later chunk);
- decode steps: every sequence's blocks gathered into one padded batch and one masked SDPA
  call. Shapes are fixed by (batch, blocks), so ``cuda_graphs.DecodeGraphs`` can record it.

FlashInfer is not wired: no paged-attention library is used, both calls are torch SDPA.
Batch invariance is a CPU rule: GPU sums follow cuBLAS and SDPA.

The unit tests run this code on the CPU device (backends.TEST_CUDA_ON_CPU_ENV,
tests/unit/test_cuda_backend_cpu.py): greedy ids equal model.generate's in float32 there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.engine.backends.base import StepMetadata
from pdserve.engine.backends.torch_sdpa import TorchBackend, rms_norm, rope
from pdserve.engine.kv_cache import block_rows


def gather_blocks(blocks: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """blocks: [kv_heads, num_blocks, block_size, D] -> [kv_heads, len(block_ids), block_size, D],
    whole blocks copied (into ``out``, a flat buffer of at least that size, where given)."""
    heads, num_blocks, block_size, head_dim = blocks.shape
    rows = block_rows(blocks, num_blocks)  # [kv_heads, num_blocks, block words]
    if out is None:
        gathered = torch.index_select(rows, 1, block_ids)
    else:
        gathered = out.view(-1)[: heads * len(block_ids) * rows.shape[2]].view(heads, len(block_ids), rows.shape[2])
        torch.index_select(rows, 1, block_ids, out=gathered)
    return gathered.view(blocks.dtype).view(heads, len(block_ids), block_size, head_dim)


class CudaBackend(TorchBackend):
    name = "cuda"

    def prepare_extra(self, meta: StepMetadata) -> None:
        if meta.decode_only:
            bs = self.kv_cache.block_size
            meta.extra["block_ids"] = meta.block_tables.long().view(-1)  # [S * max_blocks]
            lens = torch.tensor(meta.context_lens, device=self.device)
            meta.extra["mask"] = torch.arange(meta.block_tables.shape[1] * bs, device=self.device)[None, :] < lens[:, None]

    def forward(self, layer, q, k, v, meta: StepMetadata, scale):
        self.store_kv(layer, k, v, meta)
        if "mask" in meta.extra:
            return self._decode(layer, q, meta, scale)
        k_cache, v_cache = self.kv_cache.k[layer], self.kv_cache.v[layer]
        heads, kv_heads = q.shape[1], k_cache.shape[0]
        outs = []
        for i, end in enumerate(meta.context_lens):
            start, stop = meta.query_starts[i], meta.query_starts[i + 1]
            num_new = stop - start
            slots = self.context_slots(meta, i, 0, end)  # [end]
            keys, values = k_cache[:, slots].unsqueeze(0), v_cache[:, slots].unsqueeze(0)  # [1, kv_heads, end, D]
            mask = None
            if num_new not in (1, end):  # a chunk after cached tokens: query j sees positions <= end - num_new + j
                rows, cols = torch.arange(num_new, device=q.device), torch.arange(end, device=q.device)
                mask = (rows[:, None] + end - num_new >= cols[None, :]).view(1, 1, num_new, end)
            out = F.scaled_dot_product_attention(q[start:stop].transpose(0, 1).unsqueeze(0), keys, values, attn_mask=mask,
                                                 is_causal=mask is None and num_new > 1, scale=scale, enable_gqa=heads != kv_heads)
            outs.append(out[0].transpose(0, 1))  # [num_new, heads, D]
        return torch.cat(outs).reshape(q.shape[0], -1)

    def _decode(self, layer, q, meta: StepMetadata, scale):
        k_blocks, v_blocks = self.kv_cache.blocks(layer)  # [kv_heads, num_blocks, bs, D]
        num_kv_heads, _, _, head_dim = k_blocks.shape
        batch = q.shape[0]
        work = meta.extra.get("workspaces") or {}
        k = gather_blocks(k_blocks, meta.extra["block_ids"], work.get("k")).view(num_kv_heads, batch, -1, head_dim)
        v = gather_blocks(v_blocks, meta.extra["block_ids"], work.get("v")).view(num_kv_heads, batch, -1, head_dim)
        out = F.scaled_dot_product_attention(q.unsqueeze(2), k.transpose(0, 1), v.transpose(0, 1), attn_mask=meta.extra["mask"][:, None, None, :],
                                             scale=scale, enable_gqa=q.shape[1] != num_kv_heads)  # [B, heads, 1, D]
        return out.reshape(batch, -1)

    def linear(self, x, packed, out_features, bias):
        return F.linear(x, packed, bias)

    def add_rmsnorm(self, x, residual, weight, eps):
        residual = x.clone() if residual is None else residual + x
        return rms_norm(residual, weight, eps), residual

    def rope_(self, x, positions, cos, sin):
        return rope(x, positions, cos, sin)
