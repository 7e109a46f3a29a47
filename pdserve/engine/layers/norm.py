"""RMSNorm fused with the residual add before it (Zhang & Sennrich 2019; HF LlamaRMSNorm), and
Gemma's, over (1 + w)."""

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


class OffsetRMSNorm:
    """Gemma's RMSNorm (HF ``Gemma2RMSNorm``): float32 statistics, times ``1 + w`` in float32,
    then cast back, in torch ops (a row's bits depend on that row alone)."""

    def __init__(self, weight: torch.Tensor, eps: float):
        """weight: [H] the stored w (zero-centred); eps: added to the mean square."""
        self.scale, self.eps = 1.0 + weight.detach().float(), float(eps)  # [H] float32

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [M, H] -> [M, H] in x's dtype."""
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * self.scale).to(x.dtype)
