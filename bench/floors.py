"""What the two decode targets could reach at best on this machine, measured in the same run.

A decode step costs (a) the linear layers: streaming their weights (batch 1, memory-bound)
or their FLOPs (batch 32, compute-bound), (b) attention: reading each sequence's KV, and
(c) everything else: the HF layer's small ops (norms, rotary, activations, residual adds),
the Python and dispatcher cost of each of its ~45 torch ops per layer, the engine's own
per-call work, and sampling. (c) is measured directly on a **narrow twin** of the model: the
same architecture, layers, heads, head_dim, vocabulary and context, run through the same
engine, but with ``hidden_size = 16 x heads`` and ``intermediate_size = 128``, so that its
weights are ~9x fewer bytes. (c) = the twin's step (fastest of three) - its linear layers and
its attention calls as timed by ``bench/breakdown.py``'s hooks in a second run: everything
in a linear call (the Python and ctypes around it too) counts as linear, so (c) errs low and
the ratios below err towards reachable. On these shared machines (c) still moves by 1.5-3x
between runs (other tenants): compare the ratios over runs.

With (a) and (b) at the hardware limit and (c) as measured:

- best batch-1 step = (weight + KV bytes) / read bandwidth + (c) at batch 1, over the roofline
  (the same bytes / bandwidth);
- best batch-32 step = max(linear FLOPs / bf16 instruction peak, weight bytes / read bandwidth)
  + KV bytes / read bandwidth + (c) at batch 32, over the *measured* batch-1 step (the
  target's denominator), and over the best batch-1 step (a faster batch 1 makes the ratio
  larger, not smaller).

Where the first is above 1.3 or the second above 2, that target is out of reach without
fusing the HF layer's small ops (which the design keeps in transformers), whatever the
kernels do.
"""

from __future__ import annotations

import copy
from typing import Callable

import torch
from transformers import AutoModelForCausalLM

from bench.breakdown import linear_bytes, linear_flops, timed_components, weight_bytes
from pdserve.engine.engine import Engine, EngineConfig

NARROW_PER_HEAD = 16  # hidden_size of the twin = 16 x num_attention_heads
NARROW_INTERMEDIATE = 128
TWIN_TRIALS = 3  # the twin's step is the fastest of this many medians: a floor, on a machine whose speed moves


def narrow_twin(model) -> torch.nn.Module:
    """Random-weight model of ``model``'s architecture with the widths shrunk (heads, head_dim,
    layers, vocabulary kept), in its dtype and on its device. Raises ValueError where the
    config does not allow it (an architecture whose head_dim follows hidden_size)."""
    cfg = copy.deepcopy(model.config)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    cfg.hidden_size = NARROW_PER_HEAD * cfg.num_attention_heads
    cfg.intermediate_size = NARROW_INTERMEDIATE
    cfg.head_dim = head_dim
    twin = AutoModelForCausalLM.from_config(cfg, dtype=model.dtype).to(model.device).eval()
    got = twin.model.layers[0].self_attn.head_dim
    if got != head_dim:
        raise ValueError(f"narrow twin has head_dim {got}, not {head_dim}")
    return twin


def decode_floors(model, config: EngineConfig, step: Callable[[Engine, int, int, int], float], batches: list[int],
                  context: int, repeats: int, hw: dict) -> dict:
    """Per batch in (1, 32) ∩ ``batches``: the twin's step (the fastest of ``TWIN_TRIALS`` calls
    of ``step(engine, batch, context, repeats)`` -> seconds), its weight bytes, its linear and
    attention seconds per forward (hooked run), and ``small_ops_s`` = step - linear - attention
    (seconds, >= 0)."""
    twin = narrow_twin(model)
    twin_bytes = weight_bytes(twin)
    engine = Engine(twin, config, frozenset(), 8192)
    out = {}
    for batch in [b for b in (1, 32) if b in batches]:
        seconds = min(step(engine, batch, context, repeats) for _ in range(TWIN_TRIALS))
        with timed_components(twin) as parts:
            step(engine, batch, context, repeats)
        out[f"b{batch}"] = {"twin_step_s": seconds, "twin_weight_bytes": twin_bytes, "twin_linear_s": parts["linear_s"],
                            "twin_attention_s": parts["attention_s"],
                            "small_ops_s": max(seconds - parts["linear_s"] - parts["attention_s"], 0.0)}
    return out


def linear_limit_s(model, batch: int, hw: dict) -> float:
    """Seconds of a decode step's linear layers at the hardware limit: the larger of their
    weight bytes / read bandwidth and their FLOPs (LM head for every row) / the bf16
    instruction peak (one core; bf16 matmul where not measured; float32 matmul for float32)."""
    peak = hw.get("bf16_instruction_peak_flops") or hw["matmul_bf16_flops"]
    if model.dtype != torch.bfloat16:
        peak = hw["matmul_fp32_flops"]
    return max(linear_bytes(model) / hw["mem_read_bytes_per_s"], linear_flops(model, batch, lm_head_tokens=batch) / peak)


def best_ratios(model, floors: dict, by_batch: dict, kv_bytes_per_token: int, context: int, hw: dict) -> dict:
    """The two decode targets' best reachable ratios (see the module docstring); None where
    the run lacks a batch."""
    bw = hw["mem_read_bytes_per_s"]
    out = {"decode_b1_best_over_roofline": None, "decode_b32_best_over_b1": None, "decode_b32_best_over_best_b1": None}
    best = {batch: linear_limit_s(model, batch, hw) + batch * context * kv_bytes_per_token / bw + floors[f"b{batch}"]["small_ops_s"]
            for batch in (1, 32) if f"b{batch}" in floors}
    if 1 in best and 1 in by_batch:
        out["decode_b1_best_over_roofline"] = best[1] / by_batch[1]["roofline_s"]
    if 32 in best and 1 in by_batch:
        out["decode_b32_best_over_b1"] = best[32] / by_batch[1]["pdserve_s"]
    if 32 in best and 1 in best:
        out["decode_b32_best_over_best_b1"] = best[32] / best[1]
    return out
