"""The connector interface, split by role: a sender (prefill) and a receiver (decode)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVHandle:
    """Where one prompt's KV can be fetched from. Passed prefill -> router -> decode."""

    backend: str  # "grpc"
    address: str  # "host:port" of the sender's KV server
    transfer_id: str
    num_tokens: int  # prompt tokens covered by the KV


class KVSender(ABC):
    """Prefill side: holds each prompt's KV under a lease until acknowledged or expired."""

    @abstractmethod
    def put(self, transfer_id: str, kv: torch.Tensor, lease_s: float) -> KVHandle:
        """Hold ``kv: [num_layers, 2, kv_heads, tokens, head_dim]`` for at most ``lease_s`` seconds."""

    @abstractmethod
    def release(self, transfer_id: str) -> bool:
        """Free the KV now (decode confirmed receipt or the request was cancelled).

        Returns False if it was already gone.
        """

    @abstractmethod
    def stats(self) -> dict[str, int]:
        """Counters: num_held, bytes_held, num_released, num_expired."""

    @abstractmethod
    def close(self) -> None: ...


class KVReceiver(ABC):
    """Decode side: fetches KV named by a handle and acknowledges it."""

    @abstractmethod
    def fetch(self, handle: KVHandle, timeout_s: float) -> torch.Tensor:
        """Return ``kv: [num_layers, 2, kv_heads, handle.num_tokens, head_dim]``.

        Raises KVNotFoundError if the sender no longer holds it, KVTransferError
        on a timeout, a broken stream, a checksum or a layout mismatch.
        """

    @abstractmethod
    def release(self, handle: KVHandle, timeout_s: float) -> bool:
        """Tell the sender it may free the KV. Returns False if it was already gone."""

    def close(self) -> None:  # noqa: B027 - optional hook
        pass
