"""Linear: y = x @ W^T (+ b), its weight packed once in the backend's form."""

from __future__ import annotations

import torch

from pdserve.engine.backends.base import Backend


class Linear:
    def __init__(self, backend: Backend, weight: torch.Tensor, bias: torch.Tensor | None = None):
        """weight: [out_features, in_features]; bias: [out_features] or None. Fused layers
        (QKV, gate-up) pass their weights concatenated along out_features."""
        self.backend = backend
        self.out_features, self.in_features = weight.shape
        self.packed = backend.pack(weight)
        self.bias = bias.detach().contiguous() if bias is not None else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [M, in_features] -> [M, out_features]."""
        return self.backend.linear(x, self.packed, self.out_features, self.bias)
