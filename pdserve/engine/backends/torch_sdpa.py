"""The ``torch`` backend: plain torch ops, the portable reference (no compiler needed).

On a CPU it keeps the numerics rule, batch invariance, the simple way. torch's matmul sums a
row differently with a different number of rows beside it (measured: float32 ``F.linear``),
so linear layers run on chunks of exactly ``LINEAR_ROWS`` rows, the last one padded with
zeros: one matmul shape, whose rows come out the same whatever the other rows hold (measured
here, float32 and bf16, 1 and 2 threads; the batch-invariance tests check it on every run).
Multi-query SDPA also rounds a row by its neighbours, so every query row is its own call.
Correct and slow (a fallback: ``backends.select`` logs when it is taken). On a GPU, the
``cuda`` backend batches the same ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.engine.backends.base import Backend, StepMetadata

LINEAR_ROWS = 16  # rows of every matmul the torch backend runs on a CPU


def rms_norm(residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm: float32 statistics, the normalised row cast back, then the weight."""
    h = residual.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(residual.dtype)


def rope(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's rotate_half rotary: x [T, heads, D] -> a new [T, heads, D]."""
    c, s = cos[positions][:, None].to(x.dtype), sin[positions][:, None].to(x.dtype)  # [T, 1, D]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * c + rotated * s


class TorchBackend(Backend):
    name = "torch"

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: StepMetadata, scale: float) -> torch.Tensor:
        self.store_kv(layer, k, v, meta)
        k_cache, v_cache = self.kv_cache.k[layer], self.kv_cache.v[layer]  # [kv_heads, slots, D]
        heads, kv_heads = q.shape[1], k_cache.shape[0]
        out = torch.empty(q.shape[0], heads, q.shape[2], dtype=q.dtype, device=q.device)
        for i, end in enumerate(meta.context_lens):
            start = meta.query_starts[i]
            slots = self.context_slots(meta, i, 0, end)  # [end]
            keys, values = k_cache[:, slots].unsqueeze(0), v_cache[:, slots].unsqueeze(0)  # [1, kv_heads, end, D]
            for t in range(start, meta.query_starts[i + 1]):  # each query row by itself (see the module's docstring)
                p = end - (meta.query_starts[i + 1] - t) + 1  # keys 0 .. position
                row = F.scaled_dot_product_attention(q[t][None, :, None], keys[:, :, :p], values[:, :, :p], scale=scale,
                                                     enable_gqa=heads != kv_heads)  # [1, heads, 1, D]
                out[t] = row[0, :, 0]
        return out.view(q.shape[0], -1)

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        return weight.detach().contiguous()

    def linear(self, x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.shape[0]
        padded = torch.zeros(-(-rows // LINEAR_ROWS) * LINEAR_ROWS, x.shape[1], dtype=x.dtype, device=x.device)
        padded[:rows] = x
        out = torch.cat([F.linear(chunk, packed, bias) for chunk in padded.split(LINEAR_ROWS)])  # one matmul shape
        return out[:rows]

    def add_rmsnorm(self, x, residual, weight, eps):
        residual = x.clone() if residual is None else residual + x
        return rms_norm(residual, weight, eps), residual

    def rope_(self, x, positions, cos, sin):
        return rope(x, positions, cos, sin)

    def silu_mul(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
