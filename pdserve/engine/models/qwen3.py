"""Qwen3 (``Qwen3ForCausalLM``): the Llama layer with an RMSNorm over each q and k head
before rotary (HF ``Qwen3Attention``: ``q_norm``, ``k_norm`` of ``head_dim`` weights, eps
``rms_norm_eps``), and an explicit ``head_dim`` that need not be hidden / heads.

The cpu backend's one-call decoder (cpu/decoder.c) has no per-head norm, so Qwen3's layers
run one op at a time over the same C kernels (one log line says so at load).
"""

from __future__ import annotations

import logging

import torch

from pdserve.engine.layers import RMSNorm
from pdserve.engine.models.llama import DecoderLayer, LlamaForCausalLM

log = logging.getLogger(__name__)


class Qwen3DecoderLayer(DecoderLayer):
    def __init__(self, backend, params, prefix: str, index: int, cfg, rotary, quantized):
        super().__init__(backend, params, prefix, index, cfg, rotary, quantized)
        self.q_norm = RMSNorm(backend, params[prefix + "self_attn.q_norm.weight"], cfg.rms_norm_eps)  # [D]
        self.k_norm = RMSNorm(backend, params[prefix + "self_attn.k_norm.weight"], cfg.rms_norm_eps)  # [D]

    def qk_heads(self, qkv: torch.Tensor, n: int) -> torch.Tensor:
        """[N, (heads + 2 kv_heads) * D] -> RMSNorm'd q and k heads, [N, heads + kv_heads, D]."""
        d, q_end, k_end = self.head_dim, self.heads * self.head_dim, (self.heads + self.kv_heads) * self.head_dim
        q, _ = self.q_norm(qkv[:, :q_end].reshape(n * self.heads, d), None)  # [N * heads, D]
        k, _ = self.k_norm(qkv[:, q_end:k_end].reshape(n * self.kv_heads, d), None)  # [N * kv_heads, D]
        return torch.cat([q.view(n, self.heads, d), k.view(n, self.kv_heads, d)], dim=1)


class Qwen3ForCausalLM(LlamaForCausalLM):
    """pdserve's model for ``Qwen3ForCausalLM`` checkpoints."""

    layer_class = Qwen3DecoderLayer
    fusable = False

    def __init__(self, checkpoint, backend, max_positions: int, quantized=None):
        log.info("Qwen3: layers run op by op (the fused cpu decoder has no per-head q/k norm)")
        super().__init__(checkpoint, backend, max_positions, quantized)
