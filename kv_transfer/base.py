"""The connector interface, split by role: a sender (prefill) and a receiver (decode).

- ``KVSender.put`` holds a prompt's KV under a lease and returns a ``KVHandle``;
  ``pop_finished`` tells which transfers have ended (acknowledged, cancelled, expired).
- ``KVReceiver.fetch`` moves the KV named by a handle into a sink, checks it and
  acknowledges it; ``release`` cancels a transfer.

KV moves per (layer, token range) as ``k, v: [kv_heads, num_tokens, head_dim]``,
the layout of a paged pool's slots (pdserve/engine/kv_cache.py). A ``KVSource`` is what a
sender reads from (the prefill worker's blocks), a ``KVSink`` what a receiver writes
into (the decode worker's blocks), so KV goes straight from pool to pool.
"""

from __future__ import annotations

import contextlib
import threading
from abc import ABC, abstractmethod
from typing import Callable

import torch

from kv_transfer.lease import LeaseTable
from pdserve.kv_layout import KVSpec
from pdserve.messages import KVHandle  # noqa: F401 - the handle every backend passes: a message (pdserve/messages.py)


class KVSource(ABC):
    """KV held for a transfer. A source still being computed (``streamed``, layer-wise:
    kv_transfer/progress.py) overrides ``wait_layer``, ``reading`` and ``wait_first_token``;
    a finished one needs none of them."""

    spec: KVSpec
    num_tokens: int
    streamed: bool = False

    @abstractmethod
    def read(self, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) of tokens [start, end) of ``layer``: each [kv_heads, end - start, head_dim]."""

    def release(self) -> None:  # noqa: B027 - optional hook
        """Called once when the transfer is acknowledged, cancelled or its lease expires."""

    def wait_layer(self, layer: int, end: int, deadline: float, alive: Callable[[], bool] | None = None) -> None:  # noqa: B027
        """Block until tokens [0, end) of ``layer`` can be read (at once here)."""

    def reading(self) -> contextlib.AbstractContextManager:
        """Hold while copying out of the source (nothing to hold here)."""
        return contextlib.nullcontext()

    @property
    def nbytes(self) -> int:
        return self.num_tokens * self.spec.bytes_per_token


class KVSink(ABC):
    """Where received KV goes. ``first_token`` is set by the receiver when the KV was
    streamed layer-wise (kv_transfer/progress.py): prefill's first token, sent after it."""

    spec: KVSpec
    first_token: int | None = None

    @abstractmethod
    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k, v: [kv_heads, n, head_dim]`` as tokens [start, start + n) of ``layer``."""


class TensorKVSource(KVSource):
    """A contiguous ``kv: [num_layers, 2, kv_heads, num_tokens, head_dim]`` (tests, tools)."""

    def __init__(self, kv: torch.Tensor):
        self.kv = kv
        self.num_tokens = kv.shape[3]
        self.spec = KVSpec(kv.shape[0], kv.shape[2], kv.shape[4], kv.dtype)

    def read(self, layer, start, end):
        return self.kv[layer, 0, :, start:end], self.kv[layer, 1, :, start:end]


class TensorKVSink(KVSink):
    """Receives into a new ``kv: [num_layers, 2, kv_heads, num_tokens, head_dim]``."""

    def __init__(self, spec: KVSpec, num_tokens: int):
        self.spec = spec
        self.kv = torch.empty((spec.num_layers, 2, spec.num_kv_heads, num_tokens, spec.head_dim), dtype=spec.dtype)

    def write(self, layer, start, k, v):
        self.kv[layer, 0, :, start : start + k.shape[1]] = k
        self.kv[layer, 1, :, start : start + v.shape[1]] = v


class KVSender(ABC):
    """Prefill side: holds each prompt's KV under a lease (``self.table``, a
    kv_transfer.lease.LeaseTable) until acknowledged or expired."""

    table: LeaseTable[KVSource]

    @abstractmethod
    def put(self, transfer_id: str, source: KVSource, lease_s: float) -> KVHandle:
        """Hold ``source`` for at most ``lease_s`` seconds. Raises KeyError for a duplicate id."""

    def release(self, transfer_id: str) -> bool:
        """Free the KV now (decode confirmed receipt, or a cancel). False if already gone."""
        return self.table.release(transfer_id)

    def pop_finished(self) -> list[tuple[str, str]]:
        """Transfers that ended since the last call: (transfer_id, "released" | "expired")."""
        return self.table.pop_finished()

    def stats(self) -> dict[str, int]:
        """Counters: num_held, bytes_held, num_released, num_expired."""
        return self.table.stats()

    @abstractmethod
    def close(self) -> None: ...


class KVReceiver(ABC):
    """Decode side: fetches KV named by a handle into a sink, checks it, acknowledges it."""

    @abstractmethod
    def fetch(self, handle: KVHandle, sink: KVSink, timeout_s: float, cancel: threading.Event | None = None) -> str:
        """Write all ``handle.num_tokens`` tokens of every layer into ``sink``, verify every
        checksum, then acknowledge so the sender frees its copy. Returns the transport used
        ("grpc", "shm" or "loopback"). Returns only once nothing writes into ``sink`` any more.

        Raises KVIncompatibleError if the sender's fingerprint differs (naming the field),
        KVNotFoundError if the sender no longer holds the KV (released, or its lease expired
        before the acknowledgement, so what was read may be stale), KVTransferError on a
        timeout, a broken stream, a checksum or layout mismatch, or when ``cancel`` is set.
        """

    @abstractmethod
    def release(self, handle: KVHandle, timeout_s: float) -> bool:
        """Cancel: tell the sender to free the KV now. Returns False if it was already gone."""

    def stats(self) -> dict[str, float]:
        """Counters: num_fetched, bytes_fetched, fetch_seconds (and per transport)."""
        return {}

    def close(self) -> None:  # noqa: B027 - optional hook
        pass
