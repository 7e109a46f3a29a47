"""Rotary position embedding (Su et al. 2021, RoFormer) from the model's own HF table.

The cos/sin table comes from transformers' rotary module of the loaded model, evaluated
once at every position: whatever rope scaling the config names (linear, llama3, yarn), the
table is HF's own values, attention scaling included; ``longrope`` takes two (LongRopeRotary).
"""

from __future__ import annotations

import torch

from pdserve.engine.backends.base import Backend, StepMetadata


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

    def rows(self, meta: StepMetadata) -> torch.Tensor:
        """[N] int64: each new token's row of the table (its position)."""
        return meta.positions

    def __call__(self, x: torch.Tensor, meta: StepMetadata) -> torch.Tensor:
        """x: [N, heads, head_dim] (rotated in place where the backend can), the step's new
        tokens, each at its row of the table (positions below its length). Returns the
        rotated x."""
        return self.backend.rope_(x, self.rows(meta), self.cos, self.sin)


class LongRopeRotary(Rotary):
    """``longrope`` (Phi-3 128k, Phi-3.5): a short and a long table. HF picks the long one
    for a whole forward whose last position + 1 exceeds ``original_max_position_embeddings``
    (``dynamic_rope_update``), and Phi-3's ``generate`` drops the cache and recomputes the
    whole sequence the step it grows past that (``prepare_inputs_for_generation``). So every
    token of a sequence longer than ``original`` (prompt, or prompt and output so far) is on
    the long table, and every token of a shorter one on the short table; the engine
    recomputes a sequence the step it crosses (Engine.switch_rope_tables). A token's rotation,
    hence its bits, is the same in any batch or chunk, after preemption or migration, and in
    either worker. The table is the short one's first ``original`` rows, then the long one's."""

    def __init__(self, backend: Backend, short: tuple[torch.Tensor, torch.Tensor], long: tuple[torch.Tensor, torch.Tensor], original: int):
        """short, long: (cos, sin) each [P, head_dim] float32 (rotary_tables); original: HF's
        ``original_max_position_embeddings``."""
        super().__init__(backend, torch.cat([short[0][:original], long[0]]), torch.cat([short[1][:original], long[1]]))
        self.original = original

    def rows(self, meta: StepMetadata) -> torch.Tensor:
        rows = meta.extra.get("longrope_rows")  # once per step, for every layer
        if rows is None:
            long = torch.tensor([n > self.original for n in meta.rope_lens], device=meta.positions.device)[meta.token_seq.long()]  # [N]
            rows = meta.extra["longrope_rows"] = torch.where(long, meta.positions + self.original, meta.positions)
        return rows
