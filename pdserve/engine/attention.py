"""Attention over KV blocks, plugged into transformers as ``attn_implementation="pdserve_paged"``.

transformers keeps the architecture (projections, rotary, norms, MLP); every
attention layer calls ``paged_attention`` with the step's packed queries and new
keys/values. It stores the new K/V into their slots of the paged pool, gathers each
sequence's context from its blocks and attends over it:

- prefill chunks go through pdserve's C kernel where it runs (bf16, AVX512-BF16;
  ``paged_prefill.py``), rounded as the reference's one causal SDPA call over the whole
  prompt, even for a later chunk or the rest of a prefix-cache hit; else through
  transformers' own SDPA function (a whole prompt: the reference's call; a later chunk: a
  masked call, which rounds otherwise);
- decode steps (one query per sequence) run pdserve's C kernel over the blocks in place
  (``paged_decode.py``, numerics of torch's flash attention); with the kernel off or
  unavailable they gather their blocks into one padded batch for a single SDPA call.

The per-step metadata (``AttentionContext``) is set by the ModelRunner around each
forward, as in nano-vllm.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from pdserve.engine.kv_cache import PagedKVCache, block_rows
from pdserve.engine.paged_decode import paged_decode_attention
from pdserve.engine.paged_prefill import prefill_attention

ATTN_IMPLEMENTATION = "pdserve_paged"


@dataclass
class AttentionContext:
    kv_cache: PagedKVCache
    slot_mapping: torch.Tensor  # [num_new_tokens] where each new token's K/V goes
    query_starts: list[int]  # [num_seqs + 1] offsets of each sequence's new tokens
    context_lens: list[int]  # [num_seqs] tokens of context (cached + new) per sequence
    context_slots: list[torch.Tensor]  # per sequence: [context_len] slots of its whole context
    prefill_kernel: bool = False  # prompt chunks by pdserve's C kernel (paged_prefill.py), not SDPA
    # per sequence: tokens of the prompt being prefilled; the kernel rounds a chunk as the one
    # causal call over the whole prompt that the reference makes
    prompt_lens: list[int] | None = None
    # decode-only steps (one new token per sequence):
    decode_block_ids: torch.Tensor | None = None  # [num_seqs * max_blocks] block tables, padded
    decode_mask: torch.Tensor | None = None  # [num_seqs, max_blocks * block_size] bool, True = attend; None = one sequence, sliced
    decode_block_tables: torch.Tensor | None = None  # [num_seqs, max_blocks] int32 (kernel path)
    decode_context_lens: torch.Tensor | None = None  # [num_seqs] int32 (kernel path)
    # layer-wise streaming: (LayerProgress, tokens written once this step's layer is stored)
    kv_progress: list[tuple[object, int]] | None = None
    # gather buffers by name; None = this thread's, reallocated when too small (CUDA graphs
    # pass their own, sized once, as a graph keeps their address)
    workspaces: dict[str, torch.Tensor] | None = None
    # rows of the step's tokens that the reference computes in a one-token forward (decode
    # tokens): bf16 linear layers sum them as a lone row (exact_gemv.py); None = no such rows
    gemv_rows: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.query_starts[-1]


_local = threading.local()  # the step's context, per thread: engines of one process (a test's prefill and decode) step on their own


def set_context(context: AttentionContext | None) -> None:
    _local.context = context


def current_context() -> AttentionContext | None:
    return getattr(_local, "context", None)


def _workspace(name: str, numel: int, like: torch.Tensor, workspaces: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """A reused flat buffer (this thread's, unless ``workspaces`` is given): fresh multi-MB
    allocations cost page faults on every step."""
    if workspaces is None:
        workspaces = _local.__dict__.setdefault("workspaces", {})
    buf = workspaces.get(name)
    if buf is None or buf.numel() < numel or buf.dtype != like.dtype or buf.device != like.device:
        buf = workspaces[name] = torch.empty(numel, dtype=like.dtype, device=like.device)
    return buf[:numel]


def gather_blocks(blocks: torch.Tensor, block_ids: torch.Tensor, workspace: str, workspaces: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """blocks: [kv_heads, num_blocks, block_size, head_dim] -> [kv_heads, len(block_ids), block_size, head_dim].

    Copies whole blocks (as ``kv_cache.block_rows``) into a reused buffer, valid until the
    next call with the same ``workspace`` name (in ``workspaces``, default this thread's).
    """
    heads, num_blocks, block_size, head_dim = blocks.shape
    rows = block_rows(blocks, num_blocks)  # [kv_heads, num_blocks, block words]
    out = _workspace(workspace, heads * len(block_ids) * rows.shape[2], rows, workspaces).view(heads, len(block_ids), rows.shape[2])
    torch.index_select(rows, 1, block_ids, out=out)
    return out.view(blocks.dtype).view(heads, len(block_ids), block_size, head_dim)


def _decode_in_place(query, layer: int, ctx: AttentionContext, scaling):
    # query: [1, heads, B, head_dim] -> out [1, B, heads, head_dim]
    k_cache, v_cache = ctx.kv_cache.k[layer], ctx.kv_cache.v[layer]  # [kv_heads, slots, head_dim]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = paged_decode_attention(query[0].transpose(0, 1), k_cache, v_cache, ctx.decode_block_tables,
                                 ctx.decode_context_lens, ctx.kv_cache.block_size, scale)
    return out.unsqueeze(0), None


def _decode_gathered(module, query, k_blocks, v_blocks, ctx: AttentionContext, scaling):
    # query: [1, heads, B, head_dim]; k_blocks: [kv_heads, num_blocks, block_size, head_dim]
    num_kv_heads, _, block_size, head_dim = k_blocks.shape
    batch = len(ctx.context_lens)
    k = gather_blocks(k_blocks, ctx.decode_block_ids, "k", ctx.workspaces).view(num_kv_heads, batch, -1, head_dim)  # [kv_heads, B, S, head_dim]
    v = gather_blocks(v_blocks, ctx.decode_block_ids, "v", ctx.workspaces).view(num_kv_heads, batch, -1, head_dim)
    # transformers' own SDPA (reference numerics): [B, heads, 1, head_dim] against [B, kv_heads, S, head_dim]
    q = query[0].transpose(0, 1).unsqueeze(2)
    k, v = k.transpose(0, 1), v.transpose(0, 1)
    mask = None
    if ctx.decode_mask is None:  # one sequence: its context exactly, as the reference's call
        k, v = k[:, :, : ctx.context_lens[0]], v[:, :, : ctx.context_lens[0]]
    else:
        mask = ctx.decode_mask[:, None, None, :]
    out, _ = sdpa_attention_forward(module, q, k, v, mask, dropout=0.0, scaling=scaling, is_causal=False)
    return out.transpose(0, 1), None  # [B, 1, heads, hd] -> [1, B, heads, hd]


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query: [1, heads, N, head_dim]; key, value: [1, kv_heads, N, head_dim] for N packed new tokens.

    Returns (out: [1, N, heads, head_dim], None).
    """
    ctx = current_context()
    layer = module.layer_idx
    k_cache, v_cache = ctx.kv_cache.k[layer], ctx.kv_cache.v[layer]  # [kv_heads, slots, head_dim]
    k_cache.index_copy_(1, ctx.slot_mapping, key[0])
    v_cache.index_copy_(1, ctx.slot_mapping, value[0])
    if ctx.kv_progress:  # this layer's KV may go out now (kv_transfer/progress.py)
        for progress, num_tokens in ctx.kv_progress:
            progress.mark(layer, num_tokens)

    if ctx.decode_block_tables is not None:
        return _decode_in_place(query, layer, ctx, scaling)
    if ctx.decode_block_ids is not None:
        k_blocks, v_blocks = ctx.kv_cache.blocks(layer)
        return _decode_gathered(module, query, k_blocks, v_blocks, ctx, scaling)

    outs = []
    for i, slots in enumerate(ctx.context_slots):
        start, end = ctx.query_starts[i], ctx.query_starts[i + 1]
        num_new, num_ctx = end - start, ctx.context_lens[i]
        if ctx.prefill_kernel:  # whole prompt: its own K/V; a later chunk: the context's slots of the pool
            k, v, rows = (key[0, :, start:end], value[0, :, start:end], torch.arange(num_new)) if num_new == num_ctx else (k_cache, v_cache, slots)
            if k.stride() != v.stride():
                k, v = k.contiguous(), v.contiguous()
            scale = scaling if scaling is not None else query.shape[-1] ** -0.5
            prompt_len = ctx.prompt_lens[i] if ctx.prompt_lens else None
            outs.append(prefill_attention(query[0, :, start:end], k, v, rows, scale, prompt_len).unsqueeze(0))  # [1, num_new, heads, head_dim]
            continue
        q = query[:, :, start:end]  # [1, heads, num_new, head_dim]
        if num_new == num_ctx:  # a whole prompt: its K/V are this forward's (SDPA gives the same bits for the strided view)
            k, v = key[:, :, start:end], value[:, :, start:end]  # [1, kv_heads, num_ctx, head_dim]
        else:  # its context's blocks from the pool
            k, v = k_cache[:, slots].unsqueeze(0), v_cache[:, slots].unsqueeze(0)
        if num_new == num_ctx or num_new == 1:  # whole prompt, or one token: nothing to hide
            mask, is_causal = None, num_new > 1
        else:  # a chunk after cached tokens: query i sees context positions <= offset + i
            offset = num_ctx - num_new
            rows, cols = torch.arange(num_new, device=q.device), torch.arange(num_ctx, device=q.device)
            mask = (rows[:, None] + offset >= cols[None, :]).view(1, 1, num_new, num_ctx)
            is_causal = False
        out, _ = sdpa_attention_forward(module, q, k, v, mask, dropout=0.0, scaling=scaling, is_causal=is_causal)
        outs.append(out)  # [1, num_new, heads, head_dim]
    return torch.cat(outs, dim=1), None


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
