"""Start-up shared by the prefill and decode workers: threads, model and runner."""

from __future__ import annotations

import logging

import torch

from pdserve.config import ClusterConfig
from pdserve.model_loader import load_model, load_tokenizer, resolve_model_dir
from pdserve.runner import ModelRunner

log = logging.getLogger(__name__)


def assigned_num_cpus(default: int = 1) -> int:
    """CPUs Ray gave this actor (>= 1), or ``default`` outside Ray."""
    try:
        import ray

        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU")
    except Exception:  # not inside a Ray worker
        cpus = None
    return max(1, int(cpus)) if cpus else default


def eos_token_ids(model, tokenizer) -> frozenset[int]:
    ids = model.generation_config.eos_token_id
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return frozenset(ids)


def max_model_len(cfg: ClusterConfig, model_config) -> int:
    """Tokens of context (prompt + output) that every component enforces."""
    limit = model_config.max_position_embeddings
    return min(cfg.model.max_model_len, limit) if cfg.model.max_model_len else limit


def build_runner(cfg: ClusterConfig) -> ModelRunner:
    """Set torch threads to this actor's CPUs, load the model and wrap it in a ModelRunner."""
    num_threads = assigned_num_cpus()
    torch.set_num_threads(num_threads)
    model_dir = resolve_model_dir(cfg.model.path)
    model = load_model(model_dir, cfg.model.dtype)
    tokenizer = load_tokenizer(model_dir)
    log.info("loaded %s (%s) with %d torch threads", model_dir, cfg.model.dtype, num_threads)
    return ModelRunner(model, eos_token_ids(model, tokenizer), max_model_len(cfg, model.config))
