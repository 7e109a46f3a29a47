"""A GPU's KV pool sized by its memory: what is free once the weights are on it and one step at
the largest batch has run, times ``kv_cache_memory_fraction``.

As vLLM's ``gpu_memory_utilization`` profile (``vllm/v1/worker/gpu_worker.py``
``determine_available_memory``), with the fraction taken of what is free after the weights
rather than of the whole device, so other processes' memory is never counted as ours:

    kv_bytes  = fraction * (free after the weights - peak of one profiled step)
    kv_blocks = kv_bytes // (bytes per token * block_size)

The engine builds its model over a pool of just enough blocks, runs ``max_num_batched_tokens``
prompt tokens over ``max_num_seqs`` sequences through it (the largest step the scheduler
makes; its peak read from torch's allocator), frees that pool and allocates the sized one
(engine.py). The weights are read once. What the fraction leaves
(1 - fraction) holds CUDA graphs, the sampler and the allocator's fragmentation.
"""

from __future__ import annotations

import math

import torch

from pdserve.engine.sequence import Sequence
from pdserve.sampling import SamplingParams


def kv_blocks_for_memory(free_bytes: int, step_peak_bytes: int, fraction: float, bytes_per_block: int) -> int:
    """Blocks of ``bytes_per_block`` in ``fraction`` of ``free_bytes - step_peak_bytes``
    (0 when the step alone takes what is free). Raises ValueError for a fraction outside (0, 1]."""
    if not 0 < fraction <= 1:
        raise ValueError(f"kv_cache_memory_fraction must be in (0, 1], not {fraction}")
    return max(0, int(fraction * (free_bytes - step_peak_bytes))) // bytes_per_block


def profile_step_peak(model, backend, config) -> int:
    """Bytes of GPU memory the largest step takes beyond what is allocated before it (config:
    the engine's EngineConfig; engine.py imports this module, not the other way):
    ``config.max_num_batched_tokens`` prompt tokens over ``min(max_num_seqs, tokens)``
    sequences through ``model`` (pdserve's, over ``backend``, whose pool must hold
    ``profile_blocks(config)`` blocks), once. Raises ValueError off a GPU."""
    device = backend.device
    if device.type != "cuda":
        raise ValueError(f"profiling a step's memory needs the model on a GPU, not {device}")
    tokens = config.max_num_batched_tokens
    num_seqs = min(config.max_num_seqs, tokens)
    per_seq = tokens // num_seqs
    blocks_per_seq = math.ceil(per_seq / config.block_size)
    batch = []
    for i in range(num_seqs):
        seq = Sequence(f"profile-{i}", [0] * per_seq, per_seq, SamplingParams(max_tokens=1, ignore_eos=True))
        seq.block_table = list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
        batch.append((seq, per_seq))
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    with torch.inference_mode():
        logits = model.forward(backend.prepare(batch))
        del logits
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def profile_blocks(config) -> int:
    """Blocks the profiled step's pool needs (``profile_step_peak``)."""
    tokens = config.max_num_batched_tokens
    num_seqs = min(config.max_num_seqs, tokens)
    return num_seqs * math.ceil((tokens // num_seqs) / config.block_size)
