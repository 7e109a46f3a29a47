"""Cluster configuration: the typed form of ``cluster.yaml``.

Every section is a dataclass; unknown keys raise ``ConfigError`` naming the key,
so a typo never silently falls back to a default.

The three pools (``prefill``, ``decode``, ``colocated``) share one dataclass, PoolConfig.
A ``pool_defaults`` section sets keys for all three; each pool's section overrides them.
The few keys of one role (``ROLE_KEYS``) live only in that role's sections: found in
``pool_defaults`` they are refused, found in another pool's section (files written before
``pool_defaults``) they are ignored with a warning that names where they belong.
Precedence, lowest first: the pool's built-in default, ``pool_defaults``, its section.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pdserve.autoscaling import PolicyConfigError, PolicySettings


def cache_root() -> Path:
    """Where pdserve keeps what it makes once (converted models, built kernels, `pdserve up`'s
    state): ``$PDSERVE_CACHE``, else ``~/.cache/pdserve``."""
    return Path(os.environ.get("PDSERVE_CACHE", Path.home() / ".cache" / "pdserve"))


log = logging.getLogger(__name__)

CPU_KV_CACHE_TOKENS = 32768  # a CPU pool's KV tokens where neither kv_cache_tokens nor kv_cache_bytes is set

class ConfigError(ValueError):
    """A cluster.yaml value is missing, unknown or out of range."""


@dataclass
class ModelConfig:
    path: str = "smollm2"
    # "auto" = bfloat16 on a GPU or a CPU with bf16 instructions (AVX512-BF16, AMX), else
    # float32, settled once where the app is built (pdserve_app.deploy.app_config, resolve_dtype)
    dtype: str = "auto"
    # the engine's compute backend (pdserve/engine/backends): "auto" = cuda on a GPU, else cpu
    # (pdserve's C kernels) where they build, else torch (portable, slow); or one of those
    backend: str = "auto"
    max_model_len: int | None = None  # tokens; None = the model's context
    # where each worker runs its model and KV pool: "auto" = the GPU Ray gave the replica
    # (ray_actor_options.num_gpus >= 1), else the CPU; "cpu"; "cuda"
    device: str = "auto"
    # the chat template (Jinja) for chat requests instead of the tokenizer's: a file on the
    # router's node, or the template itself. A model whose template has no tool support gets
    # a Hermes-style ChatML one (router/tool_calls.py) for requests with tools
    chat_template: str | None = None
    # how tool calls are written and read back: auto (by the template), hermes, llama3
    tool_parser: str = "auto"


TOOL_PARSERS = ("auto", "hermes", "llama3")


@dataclass
class RayConfig:
    address: str | None = None
    metrics_export_port: int = 8080  # Prometheus endpoint of a head node that `pdserve up` starts


@dataclass
class RouterConfig:
    # the client APIs listen on host: loopback by default; "0.0.0.0" (or an interface's
    # address) opens them to other machines. gRPC is served by each router replica itself
    # (router/grpc_server.py), HTTP by Ray Serve's proxy
    host: str = "127.0.0.1"
    grpc_port: int = 9000
    http_port: int = 8000
    # a gRPC client that answers no keepalive ping for this long is gone: its streams are
    # cancelled and both pools freed (the backstop for a client that vanishes without a cancel)
    client_keepalive_s: float = 20.0
    # TLS on both client APIs (PEM files, on every node that runs a router replica or Serve's
    # HTTP proxy): both files or neither; tls_client_ca_file also makes the gRPC API require
    # client certificates signed by that CA (mTLS); HTTP verifies one only if a client sends it
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_client_ca_file: str | None = None
    num_replicas: int = 1
    # requests one router replica streams at once (Ray Serve's default, 5, would cap the cluster)
    max_ongoing_requests: int = 1024
    # admission control: requests one router replica admits at once; the next ones get
    # RESOURCE_EXHAUSTED / HTTP 429 with a retry hint of retry_after_s
    max_in_flight: int = 256
    # ... and while a new request would queue longer than this many seconds before it decodes
    # (a standing queue, or the prefill pool's expected wait: router/admission.py); null = never
    max_queue_s: float | None = None
    retry_after_s: float = 1.0
    max_request_bytes: int = 4 << 20  # a larger HTTP body or gRPC request is refused
    # a request whose prefill replica dies is sent again, and one whose decode replica dies
    # migrates, up to max_retries times each, retry_backoff_s apart (router/request_path.py)
    max_retries: int = 2
    retry_backoff_s: float = 0.5
    ray_actor_options: dict[str, Any] = field(default_factory=lambda: {"num_cpus": 0})
    # where Ray Serve runs its HTTP/gRPC proxies: EveryNode (any node takes requests) | HeadOnly
    proxy_location: str = "EveryNode"
    # conditional disaggregation (router/placement.py): the decode replica prefills a prompt of at
    # most local_prefill_max_tokens itself (0 = never), or one that would wait longer than
    # local_prefill_queue_s for the prefill pool (null = never; 0.05 s by default: on 2 cores it
    # took goodput from 0.5 to 2 req/s, docs/serving.md) while fewer than max_local_prefills of
    # this router's requests prefill on decode
    local_prefill_max_tokens: int = 0
    # prefill replica per prompt by cached prefix against queued tokens (router/prefix_routing.py);
    # false = Ray Serve's power of two choices
    prefix_routing: bool = True
    local_prefill_queue_s: float | None = 0.05
    max_local_prefills: int = 1


def _default_autoscaling() -> dict[str, Any]:
    """Ray Serve's autoscaling config of a pool (replica bounds, delays, metric windows)."""
    return {"min_replicas": 1, "max_replicas": 1, "upscale_delay_s": 10.0, "downscale_delay_s": 60.0, "look_back_period_s": 30.0}


@dataclass
class PoolConfig:
    """One worker pool (prefill or decode): a Ray Serve deployment."""

    autoscaling_config: dict[str, Any] = field(default_factory=_default_autoscaling)
    # pdserve's scaling signals (pdserve/autoscaling.py); ignored when autoscaling_config sets `policy`
    autoscaling_policy: dict[str, Any] = field(default_factory=dict)
    max_ongoing_requests: int = 32  # requests one replica takes at once; the rest wait in Ray Serve's queue ...
    max_queued_requests: int = 512  # ... of at most this many per caller; beyond it RESOURCE_EXHAUSTED (-1 = no limit)
    # a replica being scaled down or replaced gets this long to finish its requests (and,
    # in prefill, for decode to fetch its leased KV) before Ray Serve kills it
    graceful_shutdown_timeout_s: float = 60.0
    # one engine step running longer is a hung forward: the replica's requests go elsewhere
    # at once (WorkerStalledError) and it fails Ray Serve's health check, run every
    # health_check_period_s (a check unanswered in health_check_timeout_s fails too);
    # after 3 failures in a row Ray Serve replaces the replica
    max_step_s: float = 120.0
    health_check_period_s: float = 10.0
    health_check_timeout_s: float = 30.0
    ray_actor_options: dict[str, Any] = field(
        default_factory=lambda: {"num_cpus": 1, "num_gpus": 0, "resources": {}}
    )
    # torch threads of each replica's engine; null = ray_actor_options.num_cpus. More than
    # num_cpus lets a prefill replica borrow an idle decode core (oversubscribed when both run)
    num_threads: int | None = None
    # ranks that split each replica's model (heads and feed-forward; pdserve/engine/tensor_parallel):
    # rank 0 is the replica, the others Ray actors in its placement group (one node); the
    # group holds ray_actor_options' resources once per rank (STRICT_PACK), and
    # each rank runs num_threads threads; CPU pools of dense models
    tensor_parallel_size: int = 1
    # niceness of the engine's thread (Linux; its kernel threads inherit it): a decode pool at
    # 10 yields its core at once to a prefill replica that borrows it (num_threads: 2), where
    # at 0 the two time-slice the core and prefill's parallel steps wait on the slower thread
    engine_nice: int = 0
    # decode: > 0 makes the prefill and decode engines of a node take turns: decode waits before
    # each step while a prefill step runs, at most this many seconds, and prefill waits for a
    # running decode step (pdserve/core_share.py); with num_threads above num_cpus in both
    # pools, each has the node's cores in turn (0 = never)
    yield_to_prefill_s: float = 0.0
    # dense | quantized | auto: linear layers over the GGUF's blocks as stored (Q8_0, Q4_0,
    # Q4_1, Q4_K, Q6_K; the same bits as dense), for a decode step that reads fewer bytes; auto =
    # quantized in float32 decode and colocated pools, else dense (pdserve.worker
    # quantized_weights). An HF directory, another block type or a backend without the
    # kernels stays dense (logged)
    weights: str = "auto"
    # decode and colocated: at most this many tokens per message to the router (after the
    # first); a stream's tokens are held until this many are ready or it ends. Fewer
    # messages cost Ray's streaming, the router and the proxy less CPU per token (vLLM's
    # and SGLang's stream_interval); 1 = every token at once
    stream_interval: int = 8
    # decode: a request whose prompt's KV finds no room in the pool waits at most this long
    # (s) for blocks to free, then is refused (RESOURCE_EXHAUSTED / 429 with a retry hint)
    # rather than held until the KV deadline
    max_kv_wait_s: float = 1.0
    kv_lease_s: float = 30.0  # prefill only: seconds a prompt's KV is held for decode
    # the engine (pdserve/engine): paged KV pool and batching
    block_size: int = 16  # tokens per KV block
    kv_cache_tokens: int | None = None  # KV pool size in tokens ...
    kv_cache_bytes: int | None = None  # ... or in bytes (takes precedence); both None: CPU_KV_CACHE_TOKENS on a CPU, and on
    # a GPU this fraction of the memory free after the weights and a profiled step (engine/memory.py)
    kv_cache_memory_fraction: float = 0.9
    max_num_seqs: int = 64  # sequences per forward
    max_num_batched_tokens: int = 2048  # new tokens per forward
    chunk_size: int = 2048  # prompt tokens of one sequence per forward (chunked prefill)
    enable_prefix_caching: bool = True
    optimize: bool = True  # CPU: C heap kept (allocator.py); GPU: CUDA graphs for decode


POOLS = ("prefill", "decode", "colocated")
# PoolConfig keys that only some pools use: they live only in those pools' sections
ROLE_KEYS = {"kv_lease_s": ("prefill",), "stream_interval": ("decode", "colocated"), "max_kv_wait_s": ("decode", "colocated"),
             "yield_to_prefill_s": ("decode",)}

KV_BACKENDS = ("grpc", "shm", "cuda_ipc", "auto")
ENGINE_BACKENDS = ("auto", "cpu", "torch", "cuda")  # pdserve.engine.backends.CHOICES
_REPLACED = {key: "model.backend chooses the engine's kernels (auto, cpu, torch or cuda)" for key in ("decode_kernel", "prefill_kernel")}
FAULT_POLICIES = ("recompute", "fail")
WEIGHTS = ("auto", "dense", "quantized")  # PoolConfig.weights


@dataclass
class KVTransferConfig:
    backend: str = "auto"  # grpc | shm | auto (shm on the same node, grpc across nodes)
    bind_host: str | None = None  # None = loopback on a one-node Ray cluster, else this node's IP (prefill_worker.server.kv_bind_host)
    chunk_bytes: int = 1 << 20  # bytes of key+value per streamed chunk
    timeout_s: float = 30.0  # seconds for one whole fetch
    # a fetch that times out, breaks, fails a checksum or finds its lease expired:
    # "recompute" = the decode worker prefills the prompt itself; "fail" = the request fails
    on_fault: str = "recompute"
    # layer-wise streaming: decode starts fetching as soon as the prompt is scheduled, and
    # each layer's KV goes out as prefill writes it (kv_transfer/progress.py)
    layerwise: bool = False
    # TLS on the KV channel: the prefill side serves with cert + key (PEM files on every
    # node), the decode side verifies against ca_file; server_name = the name in the
    # certificate when it is not the prefill node's IP. All null = plaintext.
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_ca_file: str | None = None
    tls_server_name: str | None = None


MODES = ("disaggregated", "colocated")


KV_SECRET_OFF = "none"  # security.kv_secret: the explicit opt-out of the KV channel's secret


@dataclass
class SecurityConfig:
    """Secrets: null = off; a literal; or "env:NAME" = read from the environment of the
    process that deploys (``pdserve up``), then carried to the replicas in their config."""

    api_key: str | None = None  # client API: gRPC metadata "authorization: Bearer <key>", HTTP bearer token
    # KV channel between the pools: gRPC metadata on every KV call. null = a random secret
    # made for each deployment (pdserve_app.deploy.app_config); "none" = an open channel (warned)
    kv_secret: str | None = None

    def resolved(self) -> "SecurityConfig":
        """Raises ConfigError if an "env:NAME" variable is not set."""
        def one(value: str | None, key: str) -> str | None:
            if key == "kv_secret" and value == KV_SECRET_OFF:
                return None
            if value is None or not value.startswith("env:"):
                return value
            name = value[4:]
            if not os.environ.get(name):
                raise ConfigError(f"security.{key} reads the environment variable {name}, which is not set")
            return os.environ[name]

        return SecurityConfig(one(self.api_key, "api_key"), one(self.kv_secret, "kv_secret"))


def _int_in(value: Any, low: int, high: int | None = None) -> bool:
    """Whether ``value`` is an integer (YAML's, not a bool) in [low, high] (no upper bound when None)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= low and (high is None or value <= high)


def _check_autoscaling(name: str, autoscaling: Any) -> None:
    """Raises ConfigError unless ``autoscaling`` (a pool's autoscaling_config) is a mapping of
    Ray Serve's AutoscalingConfig keys that it accepts, in one line naming the problem."""
    from pydantic import ValidationError
    from ray.serve.config import AutoscalingConfig

    if not isinstance(autoscaling, dict):
        raise ConfigError(f"{name}.autoscaling_config must be a mapping (min_replicas, max_replicas, ...), not {autoscaling!r}")
    unknown = sorted(set(autoscaling) - set(AutoscalingConfig.model_fields))
    if unknown:
        raise ConfigError(f"{name}.autoscaling_config: unknown key {unknown[0]!r} (Ray Serve's keys: {', '.join(AutoscalingConfig.model_fields)})")
    try:
        AutoscalingConfig(**{k: v for k, v in autoscaling.items() if k != "policy"})
    except (ValidationError, TypeError, ValueError) as e:
        errors = e.errors() if isinstance(e, ValidationError) else [{"loc": (), "msg": str(e)}]
        where = ".".join(str(x) for x in errors[0]["loc"])
        raise ConfigError(f"{name}.autoscaling_config{'.' + where if where else ''}: {errors[0]['msg']}") from None


def _check_actor_options(name: str, actor: Any) -> None:
    """Raises ConfigError unless ``actor`` (a section's ray_actor_options) is a mapping whose
    num_cpus and num_gpus, where set, are numbers >= 0."""
    if not isinstance(actor, dict):
        raise ConfigError(f"{name}.ray_actor_options must be a mapping, not {actor!r}")
    for key in ("num_cpus", "num_gpus"):
        value = actor.get(key, 0)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
            raise ConfigError(f"{name}.ray_actor_options.{key} must be a number >= 0, not {value!r}")


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
        default_factory=lambda: PoolConfig(max_ongoing_requests=64, graceful_shutdown_timeout_s=300.0)
    )
    colocated: PoolConfig = field(
        default_factory=lambda: PoolConfig(
            max_ongoing_requests=64, graceful_shutdown_timeout_s=300.0,
            ray_actor_options={"num_cpus": 2, "num_gpus": 0, "resources": {}},
            max_num_batched_tokens=512, chunk_size=512,  # prefill chunks beside the decodes, as Sarathi-Serve
        )
    )
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> "ClusterConfig":
        """Build from a parsed YAML mapping. Raises ConfigError on unknown keys or bad values."""
        if raw is not None and not isinstance(raw, dict):
            raise ConfigError(f"cluster.yaml must be a mapping of sections (model:, prefill:, ...), not a {type(raw).__name__}")
        cfg, raw = cls(), dict(raw or {})
        defaults = raw.pop("pool_defaults", None) or {}
        if not isinstance(defaults, dict):
            raise ConfigError("cluster.yaml: pool_defaults must be a mapping of pool keys")
        for key in defaults:
            if key in ROLE_KEYS:
                raise ConfigError(f"cluster.yaml: pool_defaults.{key} is not shared: set it in {' and '.join(ROLE_KEYS[key])}")
        for section, values in raw.items():
            if section != "mode" and values is not None and not isinstance(values, dict):
                raise ConfigError(f"cluster.yaml: {section} must be a mapping of keys, not {values!r}")
        for pool in POOLS:
            own = dict(raw.get(pool) or {})
            for key in [k for k in own if k in ROLE_KEYS and pool not in ROLE_KEYS[k]]:
                log.warning("cluster.yaml: %s.%s is ignored: only %s use it (set it there)", pool, key, " and ".join(ROLE_KEYS[key]))
                del own[key]
            if defaults or own:
                raw[pool] = {**defaults, **own}
        for section, values in raw.items():
            if section not in {f.name for f in dataclasses.fields(cls)}:
                raise ConfigError(f"cluster.yaml: unknown section {section!r}")
            if section == "mode":
                cfg.mode = values
                continue
            target = getattr(cfg, section)
            known = {f.name for f in dataclasses.fields(target)}
            for key, value in (values or {}).items():
                if key in _REPLACED:
                    raise ConfigError(f"cluster.yaml: {section}.{key} is gone: {_REPLACED[key]}")
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
            try:
                raw = yaml.safe_load(f)
            except yaml.YAMLError as e:  # its message names the line and column
                raise ConfigError(f"{path} is not valid YAML: {' '.join(str(e).split())}") from None
        return cls.from_dict(raw)

    def validate(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"mode must be disaggregated or colocated, not {self.mode!r}")
        if self.model.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"model.dtype must be auto, float32, bfloat16 or float16, not {self.model.dtype!r}")
        if self.model.backend not in ENGINE_BACKENDS:
            raise ConfigError(f"model.backend must be one of {', '.join(ENGINE_BACKENDS)}, not {self.model.backend!r}")
        if self.model.max_model_len is not None and not _int_in(self.model.max_model_len, 1):
            raise ConfigError(f"model.max_model_len must be a positive number of tokens or null (the model's context), not {self.model.max_model_len!r}")
        if self.model.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"model.device must be auto, cpu or cuda, not {self.model.device!r}")
        if self.model.tool_parser not in TOOL_PARSERS:
            raise ConfigError(f"model.tool_parser must be one of {', '.join(TOOL_PARSERS)}, not {self.model.tool_parser!r}")
        if self.model.chat_template is not None and not isinstance(self.model.chat_template, str):
            raise ConfigError("model.chat_template must be a file path or a Jinja template")
        if self.kv_transfer.backend not in KV_BACKENDS:
            raise ConfigError(f"kv_transfer.backend must be one of {', '.join(KV_BACKENDS)}, not {self.kv_transfer.backend!r}")
        if self.kv_transfer.on_fault not in FAULT_POLICIES:
            raise ConfigError(f"kv_transfer.on_fault must be recompute or fail, not {self.kv_transfer.on_fault!r}")
        if not self.kv_transfer.timeout_s > 0:
            raise ConfigError("kv_transfer.timeout_s must be > 0 seconds")
        tls = [self.kv_transfer.tls_cert_file, self.kv_transfer.tls_key_file, self.kv_transfer.tls_ca_file]
        if any(tls) and not all(tls):
            raise ConfigError("kv_transfer: set all of tls_cert_file, tls_key_file and tls_ca_file, or none")
        if not isinstance(self.kv_transfer.layerwise, bool):
            raise ConfigError(f"kv_transfer.layerwise must be true or false, not {self.kv_transfer.layerwise!r}")
        if self.kv_transfer.chunk_bytes < 1024:
            raise ConfigError("kv_transfer.chunk_bytes must be at least 1024")
        if not isinstance(self.router.host, str) or not self.router.host:
            raise ConfigError(f"router.host must be an address to listen on, such as 127.0.0.1 or 0.0.0.0, not {self.router.host!r}")
        r = self.router
        for key, port in (("router.grpc_port", r.grpc_port), ("router.http_port", r.http_port), ("ray.metrics_export_port", self.ray.metrics_export_port)):
            if not _int_in(port, 1, 65535):
                raise ConfigError(f"{key} must be a TCP port from 1 to 65535, not {port!r}")
        _check_actor_options("router", r.ray_actor_options)
        if r.grpc_port == r.http_port:
            raise ConfigError(f"router.grpc_port and router.http_port must differ (both {r.grpc_port})")
        if (r.tls_cert_file is None) != (r.tls_key_file is None) or (r.tls_client_ca_file is not None and r.tls_cert_file is None):
            raise ConfigError("router TLS needs both router.tls_cert_file and router.tls_key_file (and them for tls_client_ca_file)")
        if not isinstance(self.router.client_keepalive_s, (int, float)) or not self.router.client_keepalive_s >= 1:
            raise ConfigError(f"router.client_keepalive_s must be >= 1 second, not {self.router.client_keepalive_s!r}")
        if self.router.proxy_location not in ("EveryNode", "HeadOnly"):
            raise ConfigError(f"router.proxy_location must be EveryNode or HeadOnly, not {self.router.proxy_location!r}")
        if self.router.local_prefill_max_tokens < 0 or self.router.max_local_prefills < 0 or (
                self.router.local_prefill_queue_s is not None and not self.router.local_prefill_queue_s >= 0):
            raise ConfigError("router.local_prefill_max_tokens and router.max_local_prefills must be >= 0, "
                              "router.local_prefill_queue_s null or >= 0")
        if self.router.max_retries < 0 or self.router.retry_backoff_s < 0:
            raise ConfigError("router.max_retries and router.retry_backoff_s must be >= 0")
        if self.router.max_in_flight < 1 or self.router.max_request_bytes < 1024 or not self.router.retry_after_s > 0:
            raise ConfigError("router.max_in_flight must be >= 1, router.max_request_bytes >= 1024 and router.retry_after_s > 0")
        if self.router.max_queue_s is not None and not self.router.max_queue_s > 0:
            raise ConfigError(f"router.max_queue_s must be > 0 seconds or null (never refuse for the queue), not {self.router.max_queue_s!r}")
        for key in ("api_key", "kv_secret"):
            value = getattr(self.security, key)
            if value is not None and (not isinstance(value, str) or not value or value == "env:"):
                raise ConfigError(f"security.{key} must be null, a non-empty string or \"env:NAME\"")
        if self.prefill.kv_lease_s <= 0:
            raise ConfigError("prefill.kv_lease_s must be > 0 seconds")
        for name in ("prefill", "decode", "colocated"):
            pool = getattr(self, name)
            for key in ("block_size", "max_num_seqs", "max_num_batched_tokens", "chunk_size"):
                if not isinstance(getattr(pool, key), int) or getattr(pool, key) < 1:
                    raise ConfigError(f"{name}.{key} must be a positive integer")
            for key in ("max_step_s", "health_check_period_s", "health_check_timeout_s", "graceful_shutdown_timeout_s", "max_kv_wait_s"):
                if not isinstance(getattr(pool, key), (int, float)) or not getattr(pool, key) > 0:
                    raise ConfigError(f"{name}.{key} must be > 0 seconds")
            for key in ("optimize", "enable_prefix_caching"):
                if not isinstance(getattr(pool, key), bool):
                    raise ConfigError(f"{name}.{key} must be true or false, not {getattr(pool, key)!r}")
            if pool.num_threads is not None and not _int_in(pool.num_threads, 1):
                raise ConfigError(f"{name}.num_threads must be null (num_cpus) or a positive integer, not {pool.num_threads!r}")
            if not _int_in(pool.tensor_parallel_size, 1, 64):
                raise ConfigError(f"{name}.tensor_parallel_size must be an integer from 1 to 64, not {pool.tensor_parallel_size!r}")
            if not _int_in(pool.stream_interval, 1, 64):
                raise ConfigError(f"{name}.stream_interval must be an integer from 1 to 64 tokens, not {pool.stream_interval!r}")
            wait = pool.yield_to_prefill_s
            if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait <= 2:
                raise ConfigError(f"{name}.yield_to_prefill_s must be a number of seconds from 0 (never) to 2 (a prefill step busy "
                                  f"longer counts as hung: core_share.STALE_S), not {wait!r}")
            if not _int_in(pool.engine_nice, -20, 19):
                raise ConfigError(f"{name}.engine_nice must be an integer from -20 to 19, not {pool.engine_nice!r}")
            _check_actor_options(name, pool.ray_actor_options)
            _check_autoscaling(name, pool.autoscaling_config)
            if pool.weights not in WEIGHTS:
                raise ConfigError(f"{name}.weights must be one of {', '.join(WEIGHTS)}, not {pool.weights!r}")
            for key in ("kv_cache_tokens", "kv_cache_bytes"):
                value = getattr(pool, key)
                if value is not None and not _int_in(value, 1):
                    raise ConfigError(f"{name}.{key} must be a positive integer or null, not {value!r}")
            fraction = pool.kv_cache_memory_fraction
            if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
                raise ConfigError(f"{name}.kv_cache_memory_fraction must be a number in (0, 1], not {fraction!r}")
            try:
                PolicySettings.parse(name, pool.autoscaling_policy)
            except PolicyConfigError as e:
                raise ConfigError(f"cluster.yaml: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        """The whole config as a mapping ``from_dict`` reads back: every pool's section in
        full (no ``pool_defaults``), without the keys of other roles."""
        out = dataclasses.asdict(self)
        for pool in POOLS:
            for key, roles in ROLE_KEYS.items():
                if pool not in roles:
                    del out[pool][key]
        return out
