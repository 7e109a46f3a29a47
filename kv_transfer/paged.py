"""KV sources and sinks over a worker's paged pool: KV goes from prefill's blocks to decode's blocks."""

from __future__ import annotations

from typing import Callable

import torch

from kv_transfer.base import KVSink, KVSource
from pdserve.engine.kv_cache import PagedKVCache


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

    def release(self) -> None:
        self._on_release(self.block_table)


class PagedKVSink(KVSink):
    """Writes received tokens straight into the slots of ``block_table``."""

    def __init__(self, kv_cache: PagedKVCache, block_table: list[int], num_tokens: int):
        self.kv_cache = kv_cache
        self.spec = kv_cache.spec
        self.block_table = block_table
        self._slots = kv_cache.slots(block_table, 0, num_tokens)  # [num_tokens]

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.kv_cache.write(layer, self._slots[start : start + k.shape[1]], k, v)
