"""Pick a KV transfer backend by its name in cluster.yaml (``kv_transfer.backend``)."""

from __future__ import annotations

from kv_transfer.base import KVReceiver, KVSender
from pdserve.config import KVTransferConfig


def make_sender(cfg: KVTransferConfig, node_ip: str) -> KVSender:
    """Raises ValueError for an unknown backend."""
    if cfg.backend == "grpc":
        from kv_transfer.grpc_backend import GrpcKVSender

        return GrpcKVSender(cfg.bind_host or node_ip, cfg.chunk_bytes)
    raise ValueError(f"unknown KV transfer backend {cfg.backend!r}")


def make_receiver(cfg: KVTransferConfig) -> KVReceiver:
    """Raises ValueError for an unknown backend."""
    if cfg.backend == "grpc":
        from kv_transfer.grpc_backend import GrpcKVReceiver

        return GrpcKVReceiver()
    raise ValueError(f"unknown KV transfer backend {cfg.backend!r}")
