"""Cluster configuration: the typed form of ``cluster.yaml``.

Every section is a dataclass; unknown keys raise ``ConfigError`` naming the key,
so a typo never silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A cluster.yaml value is missing, unknown or out of range."""


@dataclass
class ModelConfig:
    path: str = "smollm2"
    dtype: str = "bfloat16"
    max_model_len: int | None = None  # tokens; None = the model's context


@dataclass
class RayConfig:
    address: str | None = None
    metrics_export_port: int = 8080  # Prometheus endpoint of a head node that `pdserve up` starts


@dataclass
class RouterConfig:
    grpc_port: int = 9000
    http_port: int = 8000
    num_replicas: int = 1
    ray_actor_options: dict[str, Any] = field(default_factory=lambda: {"num_cpus": 0})


def _default_autoscaling(target: int) -> dict[str, Any]:
    return {"min_replicas": 1, "max_replicas": 1, "target_ongoing_requests": target}


@dataclass
class PoolConfig:
    """One worker pool (prefill or decode): a Ray Serve deployment."""

    autoscaling_config: dict[str, Any] = field(default_factory=lambda: _default_autoscaling(2))
    max_ongoing_requests: int = 8
    ray_actor_options: dict[str, Any] = field(
        default_factory=lambda: {"num_cpus": 1, "num_gpus": 0, "resources": {}}
    )
    kv_lease_s: float = 30.0  # prefill only: seconds a prompt's KV is held for decode
    # the engine (pdserve/engine): paged KV pool and batching
    block_size: int = 16  # tokens per KV block
    kv_cache_tokens: int | None = 32768  # KV pool size in tokens ...
    kv_cache_bytes: int | None = None  # ... or in bytes (takes precedence)
    max_num_seqs: int = 64  # sequences per forward
    max_num_batched_tokens: int = 2048  # new tokens per forward
    chunk_size: int = 2048  # prompt tokens of one sequence per forward (chunked prefill)
    enable_prefix_caching: bool = True
    optimize: bool = True  # packed oneDNN weights for bf16 linear layers (bit-identical)
    decode_kernel: bool = False  # C paged decode attention over blocks in place (faster; see engine.py)


KV_BACKENDS = ("grpc", "shm", "auto")
FAULT_POLICIES = ("recompute", "fail")


@dataclass
class KVTransferConfig:
    backend: str = "auto"  # grpc | shm | auto (shm on the same node, grpc across nodes)
    bind_host: str | None = None  # None = this node's IP
    chunk_bytes: int = 1 << 20  # bytes of key+value per streamed chunk
    timeout_s: float = 30.0  # seconds for one whole fetch
    # a fetch that times out, breaks, fails a checksum or finds its lease expired:
    # "recompute" = the decode worker prefills the prompt itself; "fail" = the request fails
    on_fault: str = "recompute"


MODES = ("disaggregated", "colocated")


@dataclass
class ClusterConfig:
    # disaggregated: prefill and decode pools; colocated: one pool doing both (the baseline
    # comparisons run against), sized by the `colocated` section
    mode: str = "disaggregated"
    model: ModelConfig = field(default_factory=ModelConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    prefill: PoolConfig = field(default_factory=PoolConfig)
    decode: PoolConfig = field(
        default_factory=lambda: PoolConfig(
            autoscaling_config=_default_autoscaling(16), max_ongoing_requests=64
        )
    )
    colocated: PoolConfig = field(
        default_factory=lambda: PoolConfig(
            autoscaling_config=_default_autoscaling(16), max_ongoing_requests=64,
            ray_actor_options={"num_cpus": 2, "num_gpus": 0, "resources": {}},
            max_num_batched_tokens=512, chunk_size=512,  # prefill chunks beside the decodes, as Sarathi-Serve
        )
    )
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> "ClusterConfig":
        """Build from a parsed YAML mapping. Raises ConfigError on unknown keys or bad values."""
        cfg = cls()
        for section, values in (raw or {}).items():
            if section not in {f.name for f in dataclasses.fields(cls)}:
                raise ConfigError(f"cluster.yaml: unknown section {section!r}")
            if section == "mode":
                cfg.mode = values
                continue
            target = getattr(cfg, section)
            known = {f.name for f in dataclasses.fields(target)}
            for key, value in (values or {}).items():
                if key not in known:
                    raise ConfigError(f"cluster.yaml: unknown key {section}.{key}")
                if isinstance(getattr(target, key), dict) and value is None:
                    value = {}
                setattr(target, key, value)
        cfg.validate()
        return cfg

    @classmethod
    def load(cls, path: str | Path | None) -> "ClusterConfig":
        """Read a cluster.yaml; ``None`` gives the embedded default."""
        if path is None:
            return cls()
        with open(path) as f:
            return cls.from_dict(yaml.safe_load(f))

    def validate(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"mode must be disaggregated or colocated, not {self.mode!r}")
        if self.model.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"model.dtype must be float32, bfloat16 or float16, not {self.model.dtype!r}")
        if self.kv_transfer.backend not in KV_BACKENDS:
            hint = " (cuda_ipc is not built yet)" if self.kv_transfer.backend == "cuda_ipc" else ""
            raise ConfigError(f"kv_transfer.backend must be one of {', '.join(KV_BACKENDS)}, not {self.kv_transfer.backend!r}{hint}")
        if self.kv_transfer.on_fault not in FAULT_POLICIES:
            raise ConfigError(f"kv_transfer.on_fault must be recompute or fail, not {self.kv_transfer.on_fault!r}")
        if not self.kv_transfer.timeout_s > 0:
            raise ConfigError("kv_transfer.timeout_s must be > 0 seconds")
        if self.kv_transfer.chunk_bytes < 1024:
            raise ConfigError("kv_transfer.chunk_bytes must be at least 1024")
        if self.prefill.kv_lease_s <= 0:
            raise ConfigError("prefill.kv_lease_s must be > 0 seconds")
        for name in ("prefill", "decode", "colocated"):
            pool = getattr(self, name)
            for key in ("block_size", "max_num_seqs", "max_num_batched_tokens", "chunk_size"):
                if not isinstance(getattr(pool, key), int) or getattr(pool, key) < 1:
                    raise ConfigError(f"{name}.{key} must be a positive integer")
            if pool.kv_cache_tokens is None and pool.kv_cache_bytes is None:
                raise ConfigError(f"{name}: set kv_cache_tokens or kv_cache_bytes")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
