"""Attention over KV blocks, plugged into transformers as ``attn_implementation="pdserve_paged"``.

transformers keeps the architecture (projections, rotary, norms, MLP); every
attention layer calls ``paged_attention`` with the step's packed queries and new
keys/values. It stores the new K/V into the paged pool, gathers each sequence's
context from its blocks and runs transformers' own SDPA function on it, so the
numerics match the reference ``model.generate`` path.

The per-step metadata (``AttentionContext``) is set by the ModelRunner around
each forward, as in nano-vllm.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from pdserve.engine.kv_cache import PagedKVCache

ATTN_IMPLEMENTATION = "pdserve_paged"


@dataclass
class AttentionContext:
    kv_cache: PagedKVCache
    slot_mapping: torch.Tensor  # [num_new_tokens] where each new token's K/V goes
    query_starts: list[int]  # [num_seqs + 1] offsets of each sequence's new tokens
    context_lens: list[int]  # [num_seqs] tokens of context (cached + new) per sequence
    context_slots: list[torch.Tensor]  # per sequence: [context_len] slots of its whole context
    # decode-only steps (one new token per sequence) are batched into one SDPA call:
    decode_slots: torch.Tensor | None = None  # [num_seqs, max_context_len], padded
    decode_mask: torch.Tensor | None = None  # [num_seqs, 1, 1, max_context_len] bool; None if no padding


_context: AttentionContext | None = None


def decode_attention(q, k, v, mask, scaling) -> torch.Tensor:
    """Attention of one query per sequence as two batched matmuls, softmax in float32.

    q: [B, heads, 1, head_dim]; k, v: [B, kv_heads, S, head_dim]; mask: [B, 1, 1, S]
    bool (True = attend) or None. Returns [B, 1, heads, head_dim].

    Used for bf16/fp16 decode: torch's CPU SDPA (flash kernel) takes ~14 ms per layer
    for 16 sequences x 512 tokens in bf16 here, these matmuls well under 1 ms.
    """
    batch, num_heads, _, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    scale = scaling if scaling is not None else head_dim**-0.5
    qg = q.reshape(batch, num_kv_heads, group, head_dim)  # query heads sharing a kv head
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scale  # [B, kv_heads, group, S]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))  # mask broadcasts over heads
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    out = torch.matmul(probs, v)  # [B, kv_heads, group, head_dim]
    return out.reshape(batch, 1, num_heads, head_dim)


def set_context(context: AttentionContext | None) -> None:
    global _context
    _context = context


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query: [1, heads, N, head_dim]; key, value: [1, kv_heads, N, head_dim] for N packed new tokens.

    Returns (out: [1, N, heads, head_dim], None).
    """
    ctx = _context
    layer = module.layer_idx
    k_cache, v_cache = ctx.kv_cache.k[layer], ctx.kv_cache.v[layer]  # [slots, kv_heads, head_dim]
    k_cache.index_copy_(0, ctx.slot_mapping, key[0].transpose(0, 1))
    v_cache.index_copy_(0, ctx.slot_mapping, value[0].transpose(0, 1))

    if ctx.decode_slots is not None:  # one query per sequence: one batched call
        q = query[0].transpose(0, 1).unsqueeze(2)  # [B, heads, 1, head_dim]
        k = k_cache[ctx.decode_slots].transpose(1, 2)  # [B, kv_heads, max_ctx, head_dim]
        v = v_cache[ctx.decode_slots].transpose(1, 2)
        if q.dtype == torch.float32:  # reference numerics: transformers' own SDPA path
            out, _ = sdpa_attention_forward(module, q, k, v, ctx.decode_mask, dropout=0.0, scaling=scaling, is_causal=False)
        else:
            out = decode_attention(q, k, v, ctx.decode_mask, scaling)
        return out.transpose(0, 1), None  # [B, 1, heads, hd] -> [1, B, heads, hd]

    outs = []
    for i, slots in enumerate(ctx.context_slots):
        start, end = ctx.query_starts[i], ctx.query_starts[i + 1]
        num_new, num_ctx = end - start, ctx.context_lens[i]
        q = query[:, :, start:end]  # [1, heads, num_new, head_dim]
        k = k_cache[slots].transpose(0, 1).unsqueeze(0)  # [1, kv_heads, num_ctx, head_dim]
        v = v_cache[slots].transpose(0, 1).unsqueeze(0)
        if num_new == num_ctx or num_new == 1:  # whole prompt, or one token: nothing to hide
            mask, is_causal = None, num_new > 1
        else:  # a chunk after cached tokens: query i sees context positions <= offset + i
            offset = num_ctx - num_new
            mask = (torch.arange(num_new)[:, None] + offset >= torch.arange(num_ctx)[None, :]).view(1, 1, num_new, num_ctx)
            is_causal = False
        out, _ = sdpa_attention_forward(module, q, k, v, mask, dropout=0.0, scaling=scaling, is_causal=is_causal)
        outs.append(out)  # [1, num_new, heads, head_dim]
    return torch.cat(outs, dim=1), None


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
