"""MoE: a feed-forward of top-k routed experts (Shazeer et al. 2017; Mixtral, Qwen3-MoE as
transformers computes them: ``MixtralTopKRouter``, ``Qwen3MoeTopKRouter``, ``MixtralExperts``).

    probs = softmax(x @ router^T) in float32            # [N, E]
    w, idx = topk(probs, k)                             # [N, k]; w / sum(w) where renormalized
    y[t] = sum over t's experts e, in id order, of w[t, e] * down_e(silu(gate_e x[t]) * up_e x[t])

Each expert runs once per step as one GEMM over the rows routed to it (a decode step reads
only the chosen experts' weights). A row's sum runs over its experts in id order whatever
else is in the batch, and each expert's GEMM gives a row the same bits at any row count, so
the layer is batch invariant.
"""

from __future__ import annotations

import torch

from pdserve.engine.backends.base import Backend
from pdserve.engine.layers.linear import Linear


class MoE:
    def __init__(self, backend: Backend, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k: int, renormalize: bool,
                 weights_in_model_dtype: bool, name: str = ""):
        """router: [E, H]; gate_up: [E, 2 I, H] (gate first); down: [E, H, I]. renormalize:
        the top-k weights divided by their sum (Mixtral always; Qwen3-MoE's ``norm_topk_prob``).
        weights_in_model_dtype: the weights cast to the model's dtype before they scale an
        expert's output (Qwen3-MoE), else kept in float32 (Mixtral)."""
        self.backend, self.top_k, self.renormalize, self.in_model_dtype = backend, top_k, renormalize, weights_in_model_dtype
        self.router = Linear(backend, router, name=f"{name}.gate")
        self.after = None  # tensor parallel: the all-reduce of the rank's partial sums (tensor_parallel/rank_model.py)
        self.experts = [(Linear(backend, gate_up[e], name=f"{name}.experts.{e}.gate_up"), Linear(backend, down[e], name=f"{name}.experts.{e}.down"))
                        for e in range(gate_up.shape[0])]

    def linears(self) -> list[Linear]:
        return [self.router, *(lin for pair in self.experts for lin in pair)]

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [N, H] -> (weights [N, k], chosen expert ids [N, k])."""
        probs = torch.softmax(self.router(x).float(), dim=-1)  # [N, E]
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)  # [N, k] each
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, chosen

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [N, H] -> [N, H]."""
        weights, chosen = self.route(x)
        if self.in_model_dtype:
            weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        for e in torch.unique(chosen).tolist():  # ascending expert ids: each row's sum in a fixed order
            rows, slot = torch.where(chosen == e)
            gate_up, down = self.experts[e]
            y = down(self.backend.silu_mul(gate_up(x[rows])))  # [rows, H]
            out.index_add_(0, rows, (y * weights[rows, slot, None]).to(x.dtype))
        return out if self.after is None else self.after(out.contiguous())
