"""Prompt attention (prefill) in bf16 with pdserve's C kernel, rounded as torch's CPU flash attention.

Queries attend causally over their prompt's keys, or, for a chunk after cached tokens, over the
whole context read in place from the paged pool; given the prompt's length, a chunk rounds as
torch's one causal call over the whole prompt (the reference's), so chunked prefill and
prefix-cache hits keep the reference's bits. The kernel (kernels/prefill_attention.c) needs
AVX512-BF16 (VDPBF16PS). It takes torch's exp and summation orders, including how torch's GEMM
splits its sums by the shape of each query block, so its outputs equal torch SDPA's bit for bit
(every blocking case on random inputs, and the bundled model's 30 layers at 250-2,048 tokens),
which keeps the engine's prompt forward equal to the reference's. Speed on one Zen 4 core,
SmolLM2's 9/3 heads x 64, 2,048 tokens: 31-36 ms per layer against torch SDPA's 80-100 ms
(135-160 against 50-60 GFLOP/s; the core's VDPBF16PS peak is 234).
"""

from __future__ import annotations

import threading

import torch

from pdserve.engine import kernels
from pdserve.engine.paged_decode import paged_decode_attention

TORCH_KV_SPLIT = 512  # torch's CPU flash attention takes keys in splits of 512 (FlashAttentionKernel.cpp)
_local = threading.local()  # per-thread scratch: a test process's engines step on their own threads


def supports(dtype: torch.dtype, device: torch.device, head_dim: int) -> bool:
    """Whether the kernel runs here: bf16 on a CPU with AVX512-BF16, head_dim 32, 64 or 128."""
    if dtype != torch.bfloat16 or device.type != "cpu" or head_dim not in (32, 64, 128):
        return False
    lib = kernels.load("prefill_attention")
    return lib is not None and bool(lib.prefill_attention_available())


def prefill_attention(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, scale: float,
                      prompt_len: int | None = None) -> torch.Tensor:
    """Causal attention of ``q_len`` new tokens over a context of ``kv_len`` tokens, the new ones last.

    query: [num_heads, q_len, head_dim] bf16 (head_dim contiguous, other strides free);
    k, v: [num_kv_heads, *, head_dim] bf16 with the same strides, head_dim contiguous: token t of
    the context is row ``rows[t]`` (``rows``: [kv_len] int64, in rows of dim 1); scale usually
    head_dim ** -0.5. Query i sees context tokens 0 .. kv_len - q_len + i.
    prompt_len: None = round as torch SDPA over these queries alone (a chunk: the masked call);
    else the length (>= kv_len) of the prompt these queries are a chunk of = round as one
    causal SDPA call over the whole prompt, the reference's prompt forward.
    Returns [q_len, num_heads, head_dim] bf16.
    Raises ValueError where the kernel cannot run (see ``supports``) or the shapes disagree.
    """
    lib = kernels.load("prefill_attention")
    num_heads, q_len, head_dim = query.shape
    num_kv_heads, kv_len = k.shape[0], rows.shape[0]
    if (lib is None or query.dtype != torch.bfloat16 or k.dtype != torch.bfloat16 or k.stride() != v.stride()
            or query.stride(2) != 1 or k.stride(2) != 1 or num_heads % num_kv_heads or kv_len < q_len or q_len < 1
            or (prompt_len is not None and prompt_len < kv_len)):
        raise ValueError(f"prefill_attention: unsupported inputs {tuple(query.shape)} {query.dtype} / {tuple(k.shape)} {k.dtype}, "
                         f"{kv_len} rows, prompt of {prompt_len}")
    offsets = (rows.to(torch.int64) * k.stride(1)).contiguous()  # [kv_len] element offsets within a head
    out = torch.empty((q_len, num_heads, head_dim), dtype=torch.bfloat16)
    numel = lib.prefill_attention_scratch_bytes(kv_len, head_dim, TORCH_KV_SPLIT)
    scratch = getattr(_local, "scratch", None)
    if scratch is None or scratch.numel() < numel:
        scratch = _local.scratch = torch.empty(numel, dtype=torch.uint8)
    # the torch call to follow: its queries (these, or the whole prompt's) and where ours start in it
    call_len, shift = (q_len, 0) if prompt_len is None else (prompt_len, kv_len - q_len)
    # torch takes the call's queries in blocks of q_split rows; its GEMM sums a block of 1 row as
    # a GEMV (decode's order), of 2-3 rows in one piece, of 4 or more in pieces (prefill_attention.c)
    q_split = 256 if call_len >= 768 else 64 if call_len >= 192 else 32  # FlashAttentionKernel.cpp
    last_start = (call_len - 1) // q_split * q_split
    last_block = call_len - last_start
    main_end = min(max(last_start - shift, 0), q_len) if last_block < 4 else q_len  # our rows before a short last block
    lone_last_row = last_block == 1 and shift + q_len == call_len
    for begin, end, single_chunk in ((0, main_end, 0), (main_end, q_len - lone_last_row, 1)):
        if begin < end and not lib.prefill_attention_bf16(
                query.data_ptr(), query.stride(1), query.stride(0), k.data_ptr(), v.data_ptr(), k.stride(0), offsets.data_ptr(),
                q_len, kv_len, call_len if prompt_len is not None else kv_len, num_heads, num_kv_heads, head_dim, scale,
                TORCH_KV_SPLIT, begin, end, single_chunk, scratch.data_ptr(), out.data_ptr()):
            raise ValueError(f"prefill_attention: the kernel refused head_dim {head_dim}")
    if lone_last_row:  # it sees the whole context: decode's kernel, over rows as 1-token blocks
        kc, vc = (k, v) if k.is_contiguous() and v.is_contiguous() else (k.contiguous(), v.contiguous())
        out[-1] = paged_decode_attention(query[:, -1:].transpose(0, 1), kc, vc, rows.to(torch.int32).view(1, -1),
                                         torch.tensor([kv_len], dtype=torch.int32), 1, scale)[0]
    return out
