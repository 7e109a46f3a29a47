"""Where a forward's time goes: linear layers, attention over the KV blocks, and the rest.

Inside real engine steps, ``timed_components`` times every call of the engine backend's
``linear`` (the LM head included) and ``forward`` (attention: storing the new K/V and the
kernel), and the whole model forward. "other" is the forward minus those two: norms,
rotary, activation, embedding and the Python between calls. The layers run one by one
while timed (the cpu backend's one-call path, cpu/decoder.c, has no calls to time), so the
breakdown's forward includes the Python that the one-call path saves. Sampling and the scheduler
are outside the forward and not counted. The timers cost about 1 us per call (~120 linear
and 30 attention calls per forward of the bundled model), which lands in "other".
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch


@contextmanager
def timed_components(engine):
    """Yields a dict that, on exit, holds per-forward means in seconds: ``forward_s``,
    ``linear_s``, ``attention_s``, ``other_s`` and ``num_forwards``. The backend and model
    are as they were afterwards (the timers are instance attributes, removed on exit)."""
    totals = {"forward_s": 0.0, "linear_s": 0.0, "attention_s": 0.0, "num_forwards": 0}
    backend, model = engine.backend, engine.model

    def timed(obj, name, key, count=False):
        original = getattr(obj, name)

        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                totals[key] += time.perf_counter() - start
                totals["num_forwards"] += count

        setattr(obj, name, wrapper)

    timed(backend, "linear", "linear_s")
    timed(backend, "forward", "attention_s")
    timed(model, "forward", "forward_s", count=True)
    fused, model.fused = getattr(model, "fused", None), None  # layer by layer, so each call is seen
    result: dict[str, float] = {}
    try:
        yield result
    finally:
        model.fused = fused
        for obj, name in ((backend, "linear"), (backend, "forward"), (model, "forward")):
            delattr(obj, name)
        n = max(totals["num_forwards"], 1)
        result.update({k: totals[k] / n for k in ("forward_s", "linear_s", "attention_s")})
        result["other_s"] = result["forward_s"] - result["linear_s"] - result["attention_s"]
        result["num_forwards"] = totals["num_forwards"]


def weight_bytes(model) -> int:
    """Bytes of every parameter of an HF model (tied ones once): what a decode step's roofline counts."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def linear_bytes(model) -> int:
    """Bytes of every nn.Linear weight of an HF model (what a decode step's linear layers must read)."""
    return sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if isinstance(m, torch.nn.Linear))


def linear_flops(model, num_tokens: int, lm_head_tokens: int = 1) -> float:
    """2 x params of the decoder layers' linears x tokens, plus the LM head for ``lm_head_tokens``."""
    layers = sum(m.weight.numel() for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear))
    return 2.0 * layers * num_tokens + 2.0 * model.lm_head.weight.numel() * lm_head_tokens
