"""Quantized weights as a GGUF stores them, for linear layers that read them in place.

A decode step reads every weight once, so its time is the weights' bytes over the memory
bandwidth: the bundled model's Q4_1 blocks (5 bits a weight) and Q8_0 embedding (8.5) are
96 MB, against 269 MB in bf16 and 537 MB in float32. A backend that takes them
(``Backend.pack_quantized``) computes with exactly the de-quantized weights, so a quantized
layer gives the dense layer's bits (cpu/linear_q.h): the engine checks that once per layer
at load (``models/llama.py``) and keeps the dense weight where it does not hold.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class QuantizedWeight:
    """A linear weight [out_features, in_features] in GGUF blocks.

    ggml_type: the block type (ggml's numbering: 2 Q4_0, 3 Q4_1, 8 Q8_0, ...); data:
    [out_features, row bytes] uint8, each row in_features / 32 blocks as the file stores them,
    in the HF model's row order."""

    ggml_type: int
    data: torch.Tensor
    out_features: int
    in_features: int

    @staticmethod
    def cat(parts: list["QuantizedWeight"]) -> "QuantizedWeight | None":
        """The parts stacked along out_features (a fused QKV or gate-up), or None where they
        are not all there or not all of one type and width."""
        if not parts or any(p is None for p in parts):
            return None
        first = parts[0]
        if any(p.ggml_type != first.ggml_type or p.in_features != first.in_features for p in parts):
            return None
        return QuantizedWeight(first.ggml_type, torch.cat([p.data for p in parts]), sum(p.out_features for p in parts), first.in_features)
