"""Rotary position embedding (Su et al. 2021, RoFormer) from the model's own HF table.

The cos/sin table comes from transformers' rotary module of the loaded model, evaluated
once at every position: whatever rope scaling the config names (linear, dynamic, llama3,
yarn), the table is HF's own values, attention scaling included.
"""

from __future__ import annotations

import torch

from pdserve.engine.backends.base import Backend


def rotary_tables(hf_rotary: torch.nn.Module, num_positions: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin): each [num_positions, head_dim] float32, from HF's ``rotary_emb(x, position_ids)``."""
    positions = torch.arange(num_positions, device=device)[None]  # [1, P]
    probe = torch.zeros(1, dtype=torch.float32, device=device)
    with torch.no_grad():
        cos, sin = hf_rotary(probe, positions)  # [1, P, head_dim] in the probe's dtype
    return cos[0].float().contiguous(), sin[0].float().contiguous()


class Rotary:
    def __init__(self, backend: Backend, cos: torch.Tensor, sin: torch.Tensor):
        self.backend, self.cos, self.sin = backend, cos, sin

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, head_dim] (rotated in place where the backend can); positions: [T]
        int64, each below the table's length. Returns the rotated x."""
        return self.backend.rope_(x, positions, self.cos, self.sin)
