"""Paged attention through torch's FlexAttention, straight over the KV pool (no gather).

FlexAttention (``torch.nn.attention.flex_attention``) computes ``softmax(score_mod(q k^T *
scale) | mask_mod) v`` and reads only the key blocks a ``BlockMask`` lists. Here the keys are
the whole pool of a layer, ``[1, kv_heads, slots, D]`` (slot ``b * block_size + i`` is token
i of block b, kv_cache.py), so a sequence's block table *is* its block-mask row: the kernel
reads each sequence's blocks where they lie, once (vLLM's FlexAttention backend does the
same, ``vllm/v1/attention/backends/flex_attention.py``).

Per step (``PagedMask.build``, tensor ops only, no loop over sequences):

- ``p2l [num_blocks]`` int32: the logical index of each pool block in the tables that list
  it this step, -1 where none does. One vector serves every sequence because a block two
  sequences share (a cached prefix, an n > 1 fork) sits at the same logical index in both:
  the prefix cache's hashes chain from the first block. A window's freed leading blocks are
  left out (their ids may be listed again, by this sequence or another);
- ``mask_mod(b, h, q, kv)``: the key's block is in the query's sequence's table at index
  ``p2l[block]``, and its position lies in ``(q_pos - window, q_pos]``;
- the ``BlockMask``. A decode-only step is a batch of S rows of one query each, keys the pool
  shared by all (a stride-0 batch view), and row s's key blocks its own table: each sequence
  reads its own blocks only. Any other step is one row of N queries in ``Q_BLOCK``-token
  blocks; a query block's key blocks are the union of its sequences' tables, duplicates
  dropped (a shared prefix block counted twice would count twice in the softmax).

Memory per step: ``num_blocks + S * max_blocks`` entries for the mask, and for a step that
is not decode-only ``N / 16 * 16 * max_blocks`` int32 block candidates (a query block holds
at most 16 sequences), whatever the pool's size.

On a GPU the kernel's tiles are 16 queries by ``block_size`` keys (``kernel_options``), so a
GPU pool's ``block_size`` must be a multiple of 16 (``check_block_size``).

On a GPU ``flex_attention`` is compiled (Triton kernels that skip unlisted blocks). On the
CPU it runs eagerly, reading the whole pool under ``mask_mod``: the test path, which checks
the numerics and (``covers``) that the block mask lists every key the mask lets through.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

Q_BLOCK = 16  # query rows per block of a non-decode step (the smallest Triton tile)


@functools.cache
def _kernel(device_type: str):
    """flex_attention compiled for a GPU; eager elsewhere (and its warning once, here)."""
    if device_type == "cuda":
        return torch.compile(flex_attention, dynamic=True)
    import warnings

    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile", category=UserWarning)
    return flex_attention


@dataclass
class PagedMask:
    """One step's paged-attention mask for one window (None: whole context)."""

    block_mask: BlockMask
    decode: bool  # a batch of S single-query rows (else one row of N queries)

    @staticmethod
    def build(block_tables: torch.Tensor, context_lens: torch.Tensor, token_seq: torch.Tensor, positions: torch.Tensor,
              num_blocks: int, block_size: int, decode: bool, window: int | None = None) -> PagedMask:
        """block_tables: [S, max_blocks] int32 (padded past each row's blocks); context_lens:
        [S] int64 tokens of context per sequence; token_seq: [N] each query's sequence;
        positions: [N] int64 each query's position; num_blocks: blocks in the pool. ``decode``:
        N == S, query s of sequence s."""
        dev, bs = block_tables.device, block_size
        S, max_blocks = block_tables.shape
        j = torch.arange(max_blocks, device=dev)[None, :]  # [1, max_blocks] logical block
        used = j < (context_lens[:, None] + bs - 1) // bs  # [S, max_blocks]
        if window is not None:  # keys before the first query's window: freed, maybe reused
            first_pos = torch.full((S,), 1 << 62, dtype=torch.long, device=dev).scatter_reduce(0, token_seq.long(), positions, "amin")
            used &= j >= (first_pos[:, None] - window + 1).clamp_min(0) // bs
        table = torch.where(used, block_tables.long(), -1)  # [S, max_blocks] the step's blocks; -1 unused
        p2l = torch.full((num_blocks + 1,), -1, dtype=torch.int32, device=dev)
        p2l.scatter_(0, torch.where(used, table, num_blocks).view(-1), j.expand(S, -1).reshape(-1).to(torch.int32))
        p2l = p2l[:num_blocks]  # [num_blocks] (the last entry took the unused ones)
        seq_of = token_seq.long()  # [N]

        def mask_mod(b, h, q_idx, kv_idx):
            s = b if decode else seq_of[q_idx]
            q_pos = positions[b] if decode else positions[q_idx]
            block = kv_idx // bs
            logical = p2l[block]
            ok = (logical >= 0) & (table[s, logical.clamp_min(0)] == block)
            kv_pos = logical * bs + kv_idx % bs
            ok = ok & (kv_pos <= q_pos)
            if window is not None:
                ok = ok & (kv_pos > q_pos - window)
            return ok

        slots = num_blocks * bs
        if decode:  # row s: its own table, in order
            kv_num = used.sum(1).to(torch.int32)  # [S]
            kv_idx = table.clamp_min(0)
            kv_idx = kv_idx.gather(1, torch.argsort((~used).to(torch.int8), dim=1, stable=True)).to(torch.int32)
            mask = BlockMask.from_kv_blocks(kv_num[:, None, None], kv_idx[:, None, None, :], BLOCK_SIZE=(Q_BLOCK, bs), mask_mod=mask_mod,
                                            seq_lengths=(1, slots), compute_q_blocks=False)  # (a query block of 16 holds the 1)
            return PagedMask(mask, True)
        N = token_seq.shape[0]
        nq = -(-N // Q_BLOCK)
        starts = torch.arange(nq, device=dev) * Q_BLOCK
        first, last = seq_of[starts], seq_of[(starts + Q_BLOCK - 1).clamp_max(N - 1)]  # [nq] sequences of each query block
        # a query block holds at most Q_BLOCK sequences: its candidates are their tables, [nq, Q_BLOCK * max_blocks]
        seqs = first[:, None] + torch.arange(Q_BLOCK, device=dev)[None, :]  # [nq, Q_BLOCK]
        member = seqs <= last[:, None]
        seqs = seqs.clamp_max(S - 1)
        big = torch.iinfo(torch.int32).max
        cand = torch.where(member[:, :, None] & used[seqs], table.to(torch.int32)[seqs], big).view(nq, -1)
        cand = torch.sort(cand, dim=1).values
        cand[:, 1:].masked_fill_(cand[:, 1:] == cand[:, :-1], big)  # a block listed twice: once
        cand = torch.sort(cand, dim=1).values
        kv_num = (cand != big).sum(1).to(torch.int32)
        kv_idx = torch.where(cand != big, cand, 0)
        mask = BlockMask.from_kv_blocks(kv_num[None, None], kv_idx[None, None], BLOCK_SIZE=(Q_BLOCK, bs), mask_mod=mask_mod,
                                        seq_lengths=(N, slots), compute_q_blocks=False)  # (q blocks: for a backward pass)
        return PagedMask(mask, False)


def check_block_size(block_size: int, device: torch.device) -> None:
    """Raises ValueError where FlexAttention's GPU tiles cannot take ``block_size`` keys."""
    if device.type == "cuda" and block_size % 16:
        raise ValueError(f"block_size must be a multiple of 16 on a GPU (FlexAttention's tiles), not {block_size}")


def _softcap_mod(cap: float):
    def score_mod(score, b, h, q_idx, kv_idx):
        return torch.tanh(score / cap) * cap
    return score_mod


def attend(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, mask: PagedMask, scale: float,
           softcap: float | None = None) -> torch.Tensor:
    """q: [N, heads, D]; k_pool, v_pool: [kv_heads, slots, D] one layer's pool -> [N, heads * D].
    ``softcap``: ``tanh(s / cap) * cap`` on the scaled scores (Gemma 2)."""
    n, heads, d = q.shape
    kernel = _kernel(q.device.type)
    options = {"kernel_options": {"BLOCK_M": Q_BLOCK, "BLOCK_N": mask.block_mask.BLOCK_SIZE[1]}} if q.device.type == "cuda" else {}
    score_mod = _softcap_mod(softcap) if softcap is not None else None
    if mask.decode:  # [S, heads, 1, D] against the pool seen by every row
        k = k_pool.unsqueeze(0).expand(n, -1, -1, -1)
        v = v_pool.unsqueeze(0).expand(n, -1, -1, -1)
        out = kernel(q.unsqueeze(2), k, v, score_mod=score_mod, block_mask=mask.block_mask, scale=scale, enable_gqa=heads != k_pool.shape[0],
                     **options)
        return out.reshape(n, heads * d)  # [S, heads, 1, D] -> [S, heads * D]
    out = kernel(q.transpose(0, 1).unsqueeze(0), k_pool.unsqueeze(0), v_pool.unsqueeze(0), score_mod=score_mod,
                 block_mask=mask.block_mask, scale=scale, enable_gqa=heads != k_pool.shape[0], **options)  # [1, heads, N, D]
    return out[0].transpose(0, 1).reshape(n, heads * d)


def covers(mask: PagedMask, dense: torch.Tensor) -> bool:
    """Whether ``mask``'s listed key blocks hold every True of ``dense`` ([B, 1, Q, slots], the
    mask_mod evaluated everywhere): what a GPU kernel, which reads only listed blocks, needs."""
    bm = mask.block_mask
    qb, kb = bm.BLOCK_SIZE
    B, _, nq, width = bm.kv_indices.shape
    used = (torch.arange(width)[None, None, :] < bm.kv_num_blocks[:, 0, :, None]).to(torch.int8)  # [B, nq, width] entries in use
    idx = torch.where(used.bool(), bm.kv_indices[:, 0].long(), 0)
    listed = torch.zeros(B, nq, dense.shape[3] // kb, dtype=torch.int8).scatter_reduce(2, idx, used, "amax").bool()
    expanded = listed.repeat_interleave(qb, dim=1).repeat_interleave(kb, dim=2)[:, : dense.shape[2]]  # [B, Q, slots]
    return bool((~dense[:, 0] | expanded).all())
