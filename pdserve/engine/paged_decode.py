"""Decode attention straight over the paged KV pool, with pdserve's C kernel.

One query token per sequence. Each sequence's keys and values are read in place from
its blocks (no gather copy), and each K/V row is loaded once for all the query heads
that share it. Numerics follow torch's CPU flash attention (see kernels/paged_attention.c):
in bf16 its exp and summation orders too, so outputs equal torch's bit for bit but for ~1 in
1,000,000 elements (one bf16 step apart); in float32, up to float32 summation order.
"""

from __future__ import annotations

import threading

import torch

from pdserve.engine import kernels

TORCH_KV_SPLIT = 512  # torch's CPU flash attention takes keys in splits of 512 (FlashAttentionKernel.cpp)
_KERNELS = {torch.bfloat16: "paged_decode_attention_bf16", torch.float32: "paged_decode_attention_f32"}
_local = threading.local()  # per-thread float32 scratch: engines of one process step on their own threads


def supports(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the kernel can run this KV dtype on this device (and compiled here)."""
    return device.type == "cpu" and dtype in _KERNELS and kernels.load() is not None


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    scale: float,
) -> torch.Tensor:
    """Attention of one new token per sequence over its blocks.

    query: [batch, num_heads, head_dim] (head_dim contiguous; other strides free);
    k_cache, v_cache: [num_kv_heads, num_slots, head_dim] contiguous (one layer of the pool);
    block_tables: [batch, max_blocks] int32; context_lens: [batch] int32, in tokens, the new
    token included (its K/V must already be stored); block_size in tokens; scale usually
    head_dim ** -0.5.
    Returns [batch, num_heads, head_dim] in query's dtype.
    Raises ValueError on a dtype/device the kernel lacks or a group of more than 64 heads.
    """
    lib = kernels.load()
    if lib is None or query.dtype not in _KERNELS or query.device.type != "cpu":
        raise ValueError(f"no paged decode kernel for {query.dtype} on {query.device}")
    batch, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[0]
    group = num_heads // num_kv_heads
    if group > 64 or num_heads % num_kv_heads or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(f"paged_decode_attention: unsupported heads {num_heads}/{num_kv_heads} or non-contiguous KV")
    if query.stride(2) != 1:
        query = query.contiguous()
    assert block_tables.dtype == torch.int32 and context_lens.dtype == torch.int32
    out = torch.empty((batch, num_heads, head_dim), dtype=query.dtype)
    numel = group * (TORCH_KV_SPLIT + 2 * head_dim) + 4 * TORCH_KV_SPLIT  # see paged_attention.c
    scratch = getattr(_local, "scratch", None)
    if scratch is None or scratch.numel() < numel:
        scratch = _local.scratch = torch.empty(numel, dtype=torch.float32)
    getattr(lib, _KERNELS[query.dtype])(
        query.data_ptr(), query.stride(0), query.stride(1), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0),
        block_tables.data_ptr(), block_tables.shape[1], context_lens.data_ptr(), batch, num_heads, num_kv_heads,
        head_dim, block_size, scale, TORCH_KV_SPLIT, scratch.data_ptr(), out.data_ptr(),
    )
    return out
