"""A KV pool's size (pdserve/engine/memory.py, pdserve/worker.py ``engine_config``): explicit
sizes win; with none, a CPU pool takes CPU_KV_CACHE_TOKENS and a GPU pool is sized by memory
at start (num_blocks 0), ``kv_cache_memory_fraction`` of what is free after the weights and
a profiled step. The profile itself runs on a GPU only (tests/gpu/test_gpu.py)."""

import pytest
import torch

from conftest import tiny_model
from pdserve.config import CPU_KV_CACHE_TOKENS, ConfigError, PoolConfig
from pdserve.engine.engine import Engine, EngineConfig
from pdserve.engine.memory import kv_blocks_for_memory
from pdserve.kv_layout import KVSpec
from pdserve.worker import engine_config
from test_engine import EOS

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32)  # 2 * 2 * 2 * 8 * 4 = 256 bytes per token


def test_blocks_for_memory_are_the_fraction_of_what_the_step_leaves():
    per_block = SPEC.bytes_per_token * 16
    assert kv_blocks_for_memory(10 << 30, 2 << 30, 0.9, per_block) == int(0.9 * (8 << 30)) // per_block
    assert kv_blocks_for_memory(1 << 30, 2 << 30, 0.9, per_block) == 0  # the step alone takes more than is free
    with pytest.raises(ValueError, match=r"kv_cache_memory_fraction must be in \(0, 1\]"):
        kv_blocks_for_memory(1 << 30, 0, 1.5, per_block)


def test_explicit_sizes_win_a_cpu_takes_its_default_and_a_gpu_is_sized_at_start():
    assert engine_config(PoolConfig(), SPEC, 4096, "decode").num_blocks == CPU_KV_CACHE_TOKENS // 16
    assert engine_config(PoolConfig(kv_cache_tokens=8192), SPEC, 4096, "decode", device="cuda").num_blocks == 512
    assert engine_config(PoolConfig(kv_cache_bytes=256 * 4096), SPEC, 4096, "decode").num_blocks == 256
    gpu = engine_config(PoolConfig(kv_cache_memory_fraction=0.5), SPEC, 1 << 20, "decode", device="cuda")
    assert gpu.num_blocks == 0 and gpu.kv_cache_memory_fraction == 0.5  # (no context check before the memory is known)
    with pytest.raises(ConfigError, match="decode: the KV pool holds 32768 tokens, less than the context of 40000"):
        engine_config(PoolConfig(), SPEC, 40000, "decode")


def test_a_pool_sized_by_memory_needs_a_gpu():
    with pytest.raises(ValueError, match="a KV pool sized by memory .num_blocks 0. needs the model on one GPU, not cpu"):
        Engine(tiny_model("llama"), EngineConfig(num_blocks=0), EOS, 128)
