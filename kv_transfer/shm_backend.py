"""shm backend: same node, CPU. The decode worker copies blocks straight out of the prefill
worker's KV pool, which lives in a shared-memory file (``ShmPoolMemory``, the prefill
engine's PoolMemory).

1. ``DescribeKV`` (gRPC control plane) returns the pool file and the transfer's block ids;
   the sender starts checksumming those blocks (one checksum per layer) in the background.
2. Meanwhile the receiver maps the file (once per sender, pages populated up front) and
   copies each layer's blocks into its own with one memcpy per run of consecutive blocks
   (no serialization, no staging buffer), checksumming each block as it lands.
3. It acknowledges with ``ReleaseKV``, sending its checksums; the sender compares them with
   its own and reports the first layer that differs. The sender frees blocks only when a
   lease is released or reaped, so an acknowledgement that finds the lease still held
   proves the blocks were not reused during the copy; one that finds it gone means the
   copy may be stale, and the transfer fails (KVNotFoundError).

Block copies and checksums are C (pdserve/engine/cpu/kv_blocks.c): both sides are on
one node, so both have it where either does.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict

import torch

from kv_transfer.base import KVSink
from pdserve.engine import cpu as kernels
from pdserve.engine.kv_cache import PagedKVCache, SharedPoolMemory, map_pool_file
from pdserve.errors import KVTransferError
from pdserve.kv_layout import KVSpec


class ShmPoolMemory(SharedPoolMemory):
    """The KV pool in a shared-memory file (engine/kv_cache.py SharedPoolMemory): what a
    same-node receiver maps with ``map_pool_file``."""


def available() -> bool:
    """Whether this process can serve or receive over shm (the C helpers build here)."""
    return kernels.load("kv_blocks") is not None


def _lib():
    lib = kernels.load("kv_blocks")
    if lib is None:
        raise KVTransferError(f"the shm KV backend's block copies are unavailable on this node: {kernels.problem('kv_blocks')}")
    return lib


def _ids(block_ids: list[int]) -> torch.Tensor:
    return torch.tensor(block_ids, dtype=torch.int32)


def layer_checksum(k: torch.Tensor, v: torch.Tensor, block_ids: torch.Tensor, block_size: int) -> int:
    """Checksum of one layer's blocks: k, v: [kv_heads, num_slots, head_dim]; block_ids: int32 [n]."""
    lib = _lib()
    block_bytes = block_size * k.shape[2] * k.element_size()
    total = 0
    for t in (k, v):
        total = lib.kv_checksum_blocks(
            t.data_ptr(), t.stride(0) * t.element_size(), block_bytes, block_ids.data_ptr(), len(block_ids), t.shape[0], total
        )
    return total


def block_ids(kv_cache: PagedKVCache, block_table: list[int], num_tokens: int) -> list[int]:
    """Sender side: the blocks holding a transfer's first ``num_tokens`` tokens."""
    return block_table[: -(-num_tokens // kv_cache.block_size)]


def checksums(kv_cache: PagedKVCache, block_ids: list[int]) -> list[int]:
    """Sender side: one checksum per layer over ``block_ids`` (K blocks, then V blocks)."""
    ids = _ids(block_ids)
    return [layer_checksum(kv_cache.k[l], kv_cache.v[l], ids, kv_cache.block_size) for l in range(kv_cache.spec.num_layers)]


class ShmReader:
    """Receiver side: maps senders' pool files (a few at a time) and copies blocks out of them.

    A mapping keeps its pool's memory alive after the sender removes the file, so the
    mappings of pools whose file is gone are dropped whenever a new one is mapped."""

    def __init__(self, max_mapped: int = 8):
        self._maps: OrderedDict[str, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self._max_mapped = max_mapped
        self._lock = threading.Lock()

    def _map(self, path: str, spec: KVSpec, num_blocks: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        with self._lock:
            if path not in self._maps:
                for gone in [p for p in self._maps if not os.path.exists(p)]:  # senders that shut down: unmap their pools
                    del self._maps[gone]
                try:
                    self._maps[path] = map_pool_file(path, spec, num_blocks, block_size)
                except (OSError, ValueError) as e:
                    raise KVTransferError(f"cannot map the sender's KV pool {path}: {e}") from None
                while len(self._maps) > self._max_mapped:
                    self._maps.popitem(last=False)
            self._maps.move_to_end(path)
            return self._maps[path]

    def copy(self, desc, sink: KVSink, cancel: threading.Event | None) -> tuple[int, list[int]]:
        """Copy a described transfer (DescribeKVResponse) into ``sink``; returns (bytes copied,
        per-layer checksums of what was copied) for the sender to compare in ReleaseKV.

        Raises KVTransferError on a bad description or when ``cancel`` is set.
        """
        spec, block_size = sink.spec, desc.block_size
        src_k, src_v = self._map(desc.shm_path, spec, desc.pool_num_blocks, block_size)
        src_ids = _ids(list(desc.block_ids))
        if block_size < 1 or len(src_ids) * block_size < desc.num_tokens:
            raise KVTransferError("shm KV description does not match this decode worker's layout")
        paged = getattr(sink, "kv_cache", None)
        lib = _lib()
        nbytes, sums = 0, []
        dst_ids = _ids(sink.block_table[: len(src_ids)]) if paged is not None else None
        for layer in range(spec.num_layers):
            if cancel is not None and cancel.is_set():
                raise KVTransferError("KV transfer cancelled")
            if paged is not None and paged.block_size == block_size:  # block to block, checksummed as it lands
                block_bytes = block_size * spec.head_dim * spec.dtype.itemsize
                got = 0
                for src, dst in ((src_k[layer], paged.k[layer]), (src_v[layer], paged.v[layer])):
                    got = lib.kv_copy_blocks_checksum(
                        src.data_ptr(), src.stride(0) * src.element_size(), dst.data_ptr(), dst.stride(0) * dst.element_size(),
                        block_bytes, src_ids.data_ptr(), dst_ids.data_ptr(), len(src_ids), spec.num_kv_heads, got)
            else:  # any other sink: token rows, then the checksum of the source as read
                slots = (src_ids[torch.arange(desc.num_tokens) // block_size].long() * block_size
                         + torch.arange(desc.num_tokens) % block_size)
                sink.write(layer, 0, src_k[layer][:, slots], src_v[layer][:, slots])
                got = layer_checksum(src_k[layer], src_v[layer], src_ids, block_size)
            sums.append(got)
            nbytes += 2 * desc.num_tokens * spec.num_kv_heads * spec.head_dim * spec.dtype.itemsize
        return nbytes, sums


