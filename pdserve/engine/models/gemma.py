"""Gemma 2 and Gemma 3 text (``Gemma2ForCausalLM``, ``Gemma3ForCausalLM``), as transformers
computes them (``modeling_gemma2``, ``modeling_gemma3``):

    h = embed(ids) * sqrt(H)                          # the scale rounded to the model dtype
    per layer:                                         # four (1 + w) RMSNorms (layers/norm.py OffsetRMSNorm)
        a = attn(norm_in(h))                           # scale query_pre_attn_scalar^-0.5; Gemma 3: (1 + w) norms on q and k heads
        h = h + norm_post_attn(a)                      # softcap: tanh(s / c) * c on the scores (Gemma 2)
        h = h + norm_post_ff(down(gelu_tanh(gate(x)) * up(x))),  x = norm_pre_ff(h)
    logits = lm_head(norm(h)); softcap: tanh(l / c) * c   # final_logit_softcapping, in the model dtype

Sliding layers (``layer_types``) see the last ``sliding_window`` positions; Gemma 3's have
their own rotary table (``rope_parameters["sliding_attention"]``). Attention with a window
shorter than the context or soft-capping goes to the backend's ``forward_windowed``: the cpu
backend's attention kernel, torch rows on the others (backends/base.py, logged once); the
linear layers on the backend's kernels; the norms and GeGLU in torch ops.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from pdserve.engine.layers import OffsetRMSNorm, Rotary
from pdserve.engine.layers.rotary import rotary_tables
from pdserve.engine.models.config import UnsupportedModelError, rope_parameter_sets
from pdserve.engine.models.llama import DecoderLayer, LlamaForCausalLM


class GemmaDecoderLayer(DecoderLayer):
    def __init__(self, backend, params, prefix: str, index: int, cfg, rotary, quantized):
        layer_type = cfg.layer_types[index] if getattr(cfg, "layer_types", None) else "full_attention"
        super().__init__(backend, params, prefix, index, cfg, rotary[layer_type] if isinstance(rotary, dict) else rotary, quantized)
        self.scale = cfg.query_pre_attn_scalar ** -0.5
        self.softcap = getattr(cfg, "attn_logit_softcapping", None)
        eps = cfg.rms_norm_eps
        self.norm_in, self.norm_post_attn, self.norm_pre_ff, self.norm_post_ff = (
            OffsetRMSNorm(params[f"{prefix}{name}.weight"], eps)
            for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"))
        q_norm = params.get(prefix + "self_attn.q_norm.weight")  # Gemma 3
        self.q_norm = OffsetRMSNorm(q_norm, eps) if q_norm is not None else None
        self.k_norm = OffsetRMSNorm(params[prefix + "self_attn.k_norm.weight"], eps) if q_norm is not None else None

    def __call__(self, h: torch.Tensor, residual: None, meta) -> tuple[torch.Tensor, None]:
        """h: [N, H] the residual stream (Gemma adds each sublayer's normed output to it)."""
        n, d = h.shape[0], self.head_dim
        qkv = self.qkv(self.norm_in(h))  # [N, (heads + 2 kv_heads) * D]
        qk = self.rotary(self.qk_heads(qkv, n), meta)
        v = qkv[:, (self.heads + self.kv_heads) * d :].view(n, self.kv_heads, d)
        o = self.attend(qk[:, : self.heads], qk[:, self.heads :], v, meta)  # [N, heads * D]
        h = h + self.norm_post_attn(self.o_proj(o))
        return h + self.norm_post_ff(self.mlp(self.norm_pre_ff(h))), None

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        """GeGLU: down(gelu_tanh(gate x) * up x), x: [N, H] -> [N, H]."""
        gate, up = self.gate_up(x).chunk(2, dim=-1)  # [N, I] each
        return self.down(F.gelu(gate, approximate="tanh") * up)

    def qk_heads(self, qkv: torch.Tensor, n: int) -> torch.Tensor:
        heads = super().qk_heads(qkv, n)  # [N, heads + kv_heads, D]
        if self.q_norm is None:
            return heads
        return torch.cat([self.q_norm(heads[:, : self.heads]), self.k_norm(heads[:, self.heads :])], dim=1)


class Gemma2ForCausalLM(LlamaForCausalLM):
    """pdserve's model for ``Gemma2ForCausalLM`` and ``Gemma3ForCausalLM`` (text) checkpoints."""

    layer_class = GemmaDecoderLayer
    activations = ("gelu_pytorch_tanh",)
    fusable = False

    @classmethod
    def check_config(cls, config) -> None:
        if any((p.get("rope_type") or p.get("type")) == "longrope" for p in rope_parameter_sets(config)):
            raise UnsupportedModelError("Gemma with rope type 'longrope': pdserve's engine implements default, linear, llama3, yarn for it")

    def __init__(self, checkpoint, backend, max_positions: int, quantized=None):
        super().__init__(checkpoint, backend, max_positions, None)  # dense weights (GGUF blocks: the Llama family's)
        cfg = checkpoint.config
        self.embed_scale = torch.tensor(cfg.hidden_size ** 0.5).to(self.dtype)  # HF: a float32 buffer cast to the weights' dtype
        self.final_norm = OffsetRMSNorm(checkpoint["model.norm.weight"], cfg.rms_norm_eps)
        self.final_softcap = getattr(cfg, "final_logit_softcapping", None)

    def make_rotary(self, checkpoint, backend, max_positions: int):
        """Gemma 3: a table per layer type (``{layer_type: Rotary}``); Gemma 2: one."""
        hf = checkpoint.rotary_emb()
        types = sorted(set(getattr(checkpoint.config, "layer_types", None) or []))
        if not isinstance(getattr(hf, "rope_type", None), dict):  # Gemma 3's module keys its tables by layer type
            return super().make_rotary(checkpoint, backend, max_positions)
        return {t: Rotary(backend, *rotary_tables(functools.partial(hf, layer_type=t), max(max_positions, 1), self.device)) for t in types}

    @torch.inference_mode()
    def forward(self, meta) -> torch.Tensor:
        h = self.embed(meta.input_ids) * self.embed_scale  # [N, H]
        for layer in self.layers:
            h, _ = layer(h, None, meta)
        logits = self.lm_head(self.final_norm(h[meta.last_token_index]))  # [S, vocab] in the model dtype
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits.float()
