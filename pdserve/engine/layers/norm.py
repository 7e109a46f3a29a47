"""RMSNorm fused with the residual add before it (Zhang & Sennrich 2019; HF LlamaRMSNorm)."""

from __future__ import annotations

import torch

from pdserve.engine.backends.base import Backend


class RMSNorm:
    def __init__(self, backend: Backend, weight: torch.Tensor, eps: float):
        self.backend, self.weight, self.eps = backend, weight.detach().contiguous(), float(eps)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x, residual: [M, H]. residual += x (x itself when None); returns
        (weight * residual / rms(residual), residual)."""
        return self.backend.add_rmsnorm(x, residual, self.weight, self.eps)
