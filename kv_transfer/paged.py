"""KV sources and sinks over a worker's paged pool: KV goes from prefill's blocks to decode's blocks."""

from __future__ import annotations

from typing import Callable

import torch

from kv_transfer.base import KVSink, KVSource
from pdserve.engine.kv_cache import PagedKVCache


MAX_RUNS = 8  # a chunk whose blocks form more runs is gathered in one copy instead (Python cost per piece)


def _runs(block_table: list[int], start: int, end: int, block_size: int) -> list[list[int]]:
    """[first slot, tokens] per run of consecutive blocks covering tokens [start, end); start block-aligned."""
    runs: list[list[int]] = []
    for first in range(start, end, block_size):
        slot, n = block_table[first // block_size] * block_size, min(block_size, end - first)
        if runs and runs[-1][0] + runs[-1][1] == slot:
            runs[-1][1] += n
        else:
            runs.append([slot, n])
    return runs


class PagedKVSource(KVSource):
    """The first ``num_tokens`` tokens held in ``block_table``; ``on_release(block_table)`` frees the blocks."""

    def __init__(self, kv_cache: PagedKVCache, block_table: list[int], num_tokens: int, on_release: Callable[[list[int]], None]):
        self.kv_cache = kv_cache
        self.spec = kv_cache.spec
        self.block_table = block_table
        self.num_tokens = num_tokens
        self._slots = kv_cache.slots(block_table, 0, num_tokens)  # [num_tokens]
        self._on_release = on_release

    def read(self, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv_cache.read(layer, self._slots[start:end])

    def pieces(self, layer: int, start: int, end: int) -> tuple[list[memoryview], list[memoryview]] | None:
        """Tokens [start, end) of ``layer`` as buffers in the [kv_heads, tokens, head_dim] byte
        order of ``read``: per K and V, one memoryview per (kv head, run of consecutive
        blocks) of the pool's own memory (no copy); or, when the blocks are scattered into
        more than MAX_RUNS runs, per kv head one view of a copy gathered in one index_select.
        None unless ``start`` is block-aligned (then any ``end`` works)."""
        bs = self.kv_cache.block_size
        if start % bs or self.kv_cache.k.device.type != "cpu":
            return None
        runs = _runs(self.block_table, start, end, bs)  # fewer, longer pieces
        if len(runs) > MAX_RUNS:
            return self._gathered(layer, start, end)
        row = self.spec.head_dim * self.spec.dtype.itemsize  # bytes of one token of one head
        slots = self.kv_cache.num_blocks * bs
        out = []
        for pool in (self.kv_cache.k[layer], self.kv_cache.v[layer]):  # [kv_heads, slots, head_dim]
            mv = memoryview(pool.view(torch.uint8).numpy()).cast("B")
            out.append([mv[(h * slots + s) * row : (h * slots + s + n) * row] for h in range(self.spec.num_kv_heads) for s, n in runs])
        return out[0], out[1]

    def _gathered(self, layer: int, start: int, end: int) -> tuple[list[memoryview], list[memoryview]]:
        bs = self.kv_cache.block_size
        ids = torch.tensor(self.block_table[start // bs : -(-end // bs)], dtype=torch.long)
        k, v = self.kv_cache.read_blocks(layer, ids)  # [kv_heads, whole blocks' tokens, head_dim]
        return tuple([memoryview(t[h, : end - start].view(torch.uint8).numpy()).cast("B") for h in range(t.shape[0])] for t in (k, v))

    def release(self) -> None:
        self._on_release(self.block_table)


class PagedKVSink(KVSink):
    """Writes received tokens straight into the slots of ``block_table``."""

    def __init__(self, kv_cache: PagedKVCache, block_table: list[int], num_tokens: int):
        self.kv_cache = kv_cache
        self.spec = kv_cache.spec
        self.block_table = block_table
        self._slots = kv_cache.slots(block_table, 0, num_tokens)  # [num_tokens]
        self._block_ids = torch.tensor(block_table, dtype=torch.long, device=kv_cache.device)  # [num_blocks]

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [kv_heads, n, head_dim], tokens [start, start + n) of ``layer``."""
        n, bs = k.shape[1], self.kv_cache.block_size
        full = 0 if start % bs else n // bs  # whole blocks from a block-aligned start: one copy per pool
        if full:
            first = start // bs
            self.kv_cache.write_blocks(layer, self._block_ids[first : first + full], k[:, : full * bs], v[:, : full * bs])
        if full * bs < n:  # the rest (a partial last block, or an unaligned start): a scatter by slot
            done = full * bs
            self.kv_cache.write(layer, self._slots[start + done : start + n], k[:, done:], v[:, done:])
