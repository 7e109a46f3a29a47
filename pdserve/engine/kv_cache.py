"""PagedKVCache: one worker's preallocated KV pool.

Layout (slot-major, a slot = one token position of one block)::

    k, v: [num_layers, num_blocks * block_size, kv_heads, head_dim]

i.e. per layer ``[num_blocks, block_size, kv_heads, head_dim]`` flattened over the
first two dims, so ``k[layer][slots]`` gathers any tokens in one indexing op.
"""

from __future__ import annotations

import torch

from pdserve.kv_layout import KVSpec


class PagedKVCache:
    def __init__(self, spec: KVSpec, num_blocks: int, block_size: int, device: str | torch.device = "cpu"):
        self.spec = spec
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (spec.num_layers, num_blocks * block_size, spec.num_kv_heads, spec.head_dim)
        self.k = torch.zeros(shape, dtype=spec.dtype, device=device)
        self.v = torch.zeros(shape, dtype=spec.dtype, device=device)

    @staticmethod
    def num_blocks_for(spec: KVSpec, block_size: int, num_tokens: int | None = None, num_bytes: int | None = None) -> int:
        """Blocks that fit ``num_tokens`` tokens or ``num_bytes`` bytes (one of them)."""
        if num_bytes is not None:
            num_tokens = num_bytes // spec.bytes_per_token
        if not num_tokens or num_tokens < block_size:
            raise ValueError(f"the KV pool must hold at least one block of {block_size} tokens")
        return num_tokens // block_size

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def slots(self, block_table: list[int], start: int, end: int) -> torch.Tensor:
        """Slot index of each token position in [start, end): LongTensor [end - start]."""
        positions = torch.arange(start, end)
        table = torch.tensor(block_table, dtype=torch.long)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) of the given slots: each [len(slots), kv_heads, head_dim] (a copy)."""
        return self.k[layer][slots], self.v[layer][slots]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k, v: [len(slots), kv_heads, head_dim]`` into the given slots."""
        self.k[layer].index_copy_(0, slots, k)
        self.v[layer].index_copy_(0, slots, v)
