"""Where a forward's time goes: linear layers, attention over the KV blocks, and the rest.

Inside real engine steps, ``timed_components`` times every ``nn.Linear`` call (forward
pre/post hooks on each layer, the LM head included), every call of the registered
attention function (``pdserve_paged``: storing the new K/V, gathering blocks, the attention
kernel) and the whole model forward. "other" is the forward minus those two: norms,
rotary, activations, residual adds and the Python between ops. Sampling and the
scheduler are outside the forward and not counted. The hooks cost about 2 us per call
(~210 linear and 30 attention calls per forward), which lands in "other".
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch
from transformers import AttentionInterface

from pdserve.engine import attention


@contextmanager
def timed_components(model):
    """Yields a dict that, on exit, holds per-forward means in seconds:
    ``forward_s``, ``linear_s``, ``attention_s``, ``other_s`` and ``num_forwards``."""
    totals = {"forward_s": 0.0, "linear_s": 0.0, "attention_s": 0.0, "num_forwards": 0}
    starts: dict[int, float] = {}

    def pre(module, args):
        starts[id(module)] = time.perf_counter()

    def post_linear(module, args, out):
        totals["linear_s"] += time.perf_counter() - starts.pop(id(module))

    def post_forward(module, args, out):
        totals["forward_s"] += time.perf_counter() - starts.pop(id(module))
        totals["num_forwards"] += 1

    def timed_attention(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            totals["attention_s"] += time.perf_counter() - start

    original = AttentionInterface._global_mapping[attention.ATTN_IMPLEMENTATION]
    handles = [model.register_forward_pre_hook(pre), model.register_forward_hook(post_forward)]
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post_linear)]
    AttentionInterface.register(attention.ATTN_IMPLEMENTATION, timed_attention)
    result: dict[str, float] = {}
    try:
        yield result
    finally:
        AttentionInterface.register(attention.ATTN_IMPLEMENTATION, original)
        for handle in handles:
            handle.remove()
        n = max(totals["num_forwards"], 1)
        result.update({k: totals[k] / n for k in ("forward_s", "linear_s", "attention_s")})
        result["other_s"] = result["forward_s"] - result["linear_s"] - result["attention_s"]
        result["num_forwards"] = totals["num_forwards"]


def weight_bytes(model) -> int:
    """Bytes of every parameter (tied ones once): what a decode step's roofline counts."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def linear_bytes(model) -> int:
    """Bytes of every nn.Linear weight (what a decode step's linear layers must read)."""
    return sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if isinstance(m, torch.nn.Linear))


def linear_flops(model, num_tokens: int, lm_head_tokens: int = 1) -> float:
    """2 x params of the decoder layers' linears x tokens, plus the LM head for ``lm_head_tokens``."""
    layers = sum(m.weight.numel() for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear))
    return 2.0 * layers * num_tokens + 2.0 * model.lm_head.weight.numel() * lm_head_tokens
