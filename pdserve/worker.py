"""Start-up shared by the prefill and decode workers: threads, model, engine, KV fingerprint.

Where a worker's KV pool lives is the caller's choice (``build_engine``'s ``kv_memory``):
the prefill worker puts it where kv_transfer's same-node backends can read it
(``kv_transfer.factory.prefill_pool_memory``); this module imports no transport.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from pdserve.config import CPU_KV_CACHE_TOKENS, ClusterConfig, ConfigError, PoolConfig
from pdserve.engine.allocator import release_free_memory
from pdserve.engine.checkpoint import config_architecture
from pdserve.engine.engine import Engine, EngineConfig
from pdserve.engine.kv_cache import PagedKVCache, PoolMemory
from pdserve.engine.models import UnsupportedModelError, check_supported
from pdserve.engine.tensor_parallel.shard import check_tensor_parallel
from pdserve.kv_fingerprint import KVFingerprint
from pdserve.kv_layout import KVSpec
from pdserve.model_loader import gguf_source, load_checkpoint, load_tokenizer, resolve_dtype, resolve_model_dir
from pdserve.structured import Grammars

log = logging.getLogger(__name__)

PREFILL_DEADLINE_S = 300.0  # longest a prompt may wait and run in a prefill worker before the request fails


def assigned_num_cpus(default: int = 1) -> int:
    """CPUs Ray gave this actor (>= 1), or ``default`` outside Ray."""
    try:
        import ray

        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU")
    except Exception:  # not inside a Ray worker
        cpus = None
    return max(1, int(cpus)) if cpus else default


def replica_name() -> str:
    """This Ray Serve replica's id ("" outside a replica): which replica answered a stats call."""
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - not inside a Serve replica
        return ""


def rss_bytes() -> int:
    """Resident memory of this process, bytes (what a soak test watches for leaks)."""
    import psutil

    return psutil.Process().memory_info().rss


def eos_token_ids(model, tokenizer) -> frozenset[int]:
    """The generation config's eos ids (``model``: a Checkpoint or transformers model) and the tokenizer's."""
    generation = getattr(model, "generation_config", None)
    ids = generation.eos_token_id if generation is not None else None
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return frozenset(ids)


def max_model_len(cfg: ClusterConfig, model_config) -> int:
    """Tokens of context (prompt + output) that every component enforces: ``model.max_model_len``,
    or the model's own (``max_position_embeddings``) when it is null. Raises ConfigError for
    one longer than the model's, which its position table does not cover."""
    limit = model_config.max_position_embeddings
    if cfg.model.max_model_len is not None and cfg.model.max_model_len > limit:
        raise ConfigError(f"model.max_model_len {cfg.model.max_model_len} is more than the model's context of {limit} tokens "
                          "(max_position_embeddings); lower it or leave it null")
    return cfg.model.max_model_len or limit


def engine_config(pool: PoolConfig, spec: KVSpec, max_len: int, pool_name: str, backend: str = "auto", device: str = "cpu") -> EngineConfig:
    """The pool's engine settings on ``device``. The KV pool: ``kv_cache_bytes``, else
    ``kv_cache_tokens``, else on a GPU sized by memory at start (num_blocks 0:
    ``kv_cache_memory_fraction``, engine/memory.py), on a CPU CPU_KV_CACHE_TOKENS. Raises
    ConfigError if a pool of known size cannot hold one request of ``max_len`` tokens."""
    num_blocks = 0  # (sized by memory on the GPU)
    if pool.kv_cache_bytes is not None or pool.kv_cache_tokens is not None or device != "cuda":
        tokens = pool.kv_cache_tokens if pool.kv_cache_tokens is not None else CPU_KV_CACHE_TOKENS  # (bytes win where set)
        try:
            num_blocks = PagedKVCache.num_blocks_for(spec, pool.block_size, tokens, pool.kv_cache_bytes)
        except ValueError as e:  # a pool smaller than one block
            raise ConfigError(f"{pool_name}: {e} (kv_cache_tokens/kv_cache_bytes)") from None
        if num_blocks * pool.block_size < max_len:
            raise ConfigError(
                f"{pool_name}: the KV pool holds {num_blocks * pool.block_size} tokens, less than the "
                f"context of {max_len}; raise kv_cache_tokens/kv_cache_bytes or lower model.max_model_len"
            )
    return EngineConfig(
        num_blocks=num_blocks, block_size=pool.block_size, max_num_seqs=pool.max_num_seqs,
        max_num_batched_tokens=pool.max_num_batched_tokens, chunk_size=pool.chunk_size,
        enable_prefix_caching=pool.enable_prefix_caching, optimize=pool.optimize,
        backend=backend, tensor_parallel_size=pool.tensor_parallel_size, kv_cache_memory_fraction=pool.kv_cache_memory_fraction,
    )


def check_pools(cfg: ClusterConfig, model_config, dtype: str) -> None:
    """What each pool's replicas would refuse at start, checked where pdserve is deployed
    from (``pdserve up``) so that it fails in one line, not in Ray's logs. ``model_config``:
    the model's transformers config; ``dtype``: the settled dtype name (``resolve_dtype``).
    Raises ConfigError naming the pool and the problem."""
    max_len = max_model_len(cfg, model_config)
    try:
        check_supported(model_config, max_len=max_len)
    except UnsupportedModelError as e:
        raise ConfigError(str(e)) from None
    spec = KVSpec.from_model_config(model_config, getattr(torch, dtype))
    for name in ("colocated",) if cfg.mode == "colocated" else ("prefill", "decode"):
        pool = getattr(cfg, name)
        on_gpu = cfg.model.device != "cpu" and float(pool.ray_actor_options.get("num_gpus") or 0) >= 1  # sized by its memory there
        engine_config(pool, spec, max_len, name, cfg.model.backend, "cuda" if on_gpu else "cpu")
        try:
            check_tensor_parallel(model_config, config_architecture(model_config), getattr(cfg, name).tensor_parallel_size)
        except UnsupportedModelError as e:
            raise ConfigError(f"{name}: {e}") from None


def worker_device(cfg: ClusterConfig) -> str:
    """"cuda" or "cpu" for this worker (``model.device``; "auto" = cuda when Ray gave this
    actor a GPU). Raises ConfigError for "cuda" without a visible CUDA device."""
    if cfg.model.device == "cpu":
        return "cpu"
    try:
        import ray

        gpu_ids = ray.get_gpu_ids() if ray.is_initialized() else []
    except Exception:  # noqa: BLE001 - not inside a Ray worker
        gpu_ids = []
    if cfg.model.device == "auto" and not gpu_ids:
        return "cpu"
    if not torch.cuda.is_available():
        raise ConfigError("model.device is cuda but this worker sees no CUDA device (give the pool ray_actor_options.num_gpus: 1)")
    return "cuda"


KVMemoryHook = Callable[[str, KVSpec, EngineConfig], "tuple[PoolMemory | None, str]"]


def build_engine(cfg: ClusterConfig, pool_name: str, kv_memory: KVMemoryHook | None = None) -> tuple[Engine, KVFingerprint]:
    """Set torch threads to this actor's CPUs, load the model on its device and build its Engine.

    ``kv_memory(device, spec, engine_config)`` gives (the memory its KV pool lives in, where
    that is for the log), e.g. ``kv_transfer.factory.prefill_pool_memory``; None keeps the
    pool in private memory. Returns the engine and this worker's KV fingerprint. Raises
    ConfigError (also from ``kv_memory``).
    """
    num_threads = getattr(cfg, pool_name).num_threads or assigned_num_cpus()  # per tensor-parallel rank: each holds a bundle of these
    torch.set_num_threads(num_threads)
    device = worker_device(cfg)
    model_dir = resolve_model_dir(cfg.model.path)
    dtype = resolve_dtype(cfg)  # as app_config did: "auto" never reaches a worker deployed through it
    model = load_checkpoint(model_dir, dtype, device)  # weights read as the engine packs them (one copy at load)
    tokenizer = load_tokenizer(model_dir)
    max_len = max_model_len(cfg, model.config)
    spec = KVSpec.from_model_config(model.config, model.dtype)
    config = engine_config(getattr(cfg, pool_name), spec, max_len, pool_name, cfg.model.backend, device)
    if cfg.kv_transfer.backend == "cuda_ipc" and device != "cuda":
        raise ConfigError("kv_transfer.backend cuda_ipc needs both pools on GPUs (model.device, ray_actor_options.num_gpus)")
    memory, where = kv_memory(device, spec, config) if kv_memory is not None else (None, f"private {device} memory")
    log.info("%s: %s (%s) on %s, %d torch threads, %s, KV pool in %s", pool_name, model_dir, dtype, device, num_threads, config, where)
    quantized = quantized_weights(cfg, pool_name, model.config, dtype) if device == "cpu" and cfg.model.backend in ("auto", "cpu") else None
    eos = eos_token_ids(model, tokenizer)
    grammars = Grammars(tokenizer, model.config.vocab_size, eos)  # structured output's grammars (~0.4 s to build)
    engine = Engine(model, config, eos, max_len, kv_memory=memory, quantized=quantized, grammars=grammars)
    fingerprint = KVFingerprint.of(model, tokenizer, cfg.model.path, config.block_size)  # the weights as they were read
    if quantized is not None:
        log.info("%s: linear layers over the GGUF's blocks: %s", pool_name, engine.model.quantized)
    if hasattr(model, "close"):
        model.close()
    del model  # the engine holds what it computes with (no dense copy where it reads blocks)
    release_free_memory()
    return engine, fingerprint


def quantized_weights(cfg: ClusterConfig, pool_name: str, model_config, dtype: str) -> dict | None:
    """The GGUF's quantized weights for this pool, or None for dense ones.

    ``weights: quantized`` takes them in any pool; ``auto`` in decode and colocated pools in
    float32, where a step over the blocks was measured 2.2-2.3x faster at batch 1 than over
    the dense float32 weights, and not in bf16, where the blocks' widening costs more than
    the bf16 bytes it saves (docs/engine.md). A model that is no GGUF stays dense (logged),
    as does one whose header ``gguf_weights.read_header`` refuses (a warning says why); where
    the engine's backend has no kernel for a block type it keeps the dense weights
    (engine/layers/linear.py). The KV fingerprint hashes the de-quantized model either way:
    the computed bits are the same.
    """
    mode = getattr(cfg, pool_name).weights
    if mode == "dense" or (mode == "auto" and (pool_name == "prefill" or dtype != "float32")):
        return None
    source = gguf_source(cfg.model.path)
    if source is None:
        log.info("%s: weights %s, but %s is no GGUF: dense weights", pool_name, mode, cfg.model.path)
        return None
    from pdserve.engine.cpu import ops
    from pdserve.gguf_weights import read_quantized

    try:
        return read_quantized(source, model_config, set(ops.QUANT_TYPES))
    except ValueError as e:  # a header this reader does not take (a big-endian GGUF): the de-quantized model serves
        log.warning("%s: weights %s, but %s: dense weights", pool_name, mode, e)
        return None
