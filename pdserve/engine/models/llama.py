"""The Llama family (Llama, Qwen2, SmolLM): pdserve's own forward over engine/layers.

Per decoder layer, six backend calls and two norms:

    x, res = add_rmsnorm(h, res)             # [N, H]
    q, k, v = split(qkv(x))                  # fused QKV: [N, (heads + 2 kv_heads) * D]
    rope_(q, k)                              # in place, one call
    o = attention(q, k, v)                   # stores k, v in the pool: [N, heads * D]
    x, res = add_rmsnorm(o_proj(o), res)
    h = down(silu_mul(gate_up(x)))           # fused gate-up: [N, 2 I]

On the cpu backend all layers of a step run as one C call over the same kernels
(``backend.fuse_layers``, cpu/decoder.c; the same bits), except in a prefill that streams its
KV layer by layer, which marks each layer as it is stored.

The weights come from the transformers model loaded by ``model_loader`` (HF directories and
GGUF alike); its modules are not called. Shapes follow the config: Qwen2 adds biases to the
QKV projection, Llama may (``attention_bias``, ``mlp_bias``); both tie or untie lm_head.
"""

from __future__ import annotations

import logging

import torch

from pdserve.engine.backends.base import Backend, StepMetadata
from pdserve.engine.layers import Embedding, Linear, RMSNorm, Rotary
from pdserve.engine.layers.rotary import rotary_tables
from pdserve.engine.quantized import QuantizedWeight

log = logging.getLogger(__name__)


def _cat(params: dict[str, torch.Tensor], names: list[str]) -> torch.Tensor | None:
    found = [params.get(n) for n in names]
    if all(t is None for t in found):
        return None
    return torch.cat([t for t in found if t is not None])


class DecoderLayer:
    # the checkpoint's projections fused into one linear layer each, in this order
    QKV = ("q_proj", "k_proj", "v_proj")
    GATE_UP = ("gate_proj", "up_proj")

    def __init__(self, backend: Backend, params: dict[str, torch.Tensor], prefix: str, index: int, cfg, rotary: Rotary,
                 quantized: dict[str, QuantizedWeight]):
        self.backend, self.index, self.rotary = backend, index, rotary
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.scale = self.head_dim ** -0.5
        eps = cfg.rms_norm_eps
        attn, mlp = prefix + "self_attn.", prefix + "mlp."
        def linear(names: list[str]) -> Linear:  # one projection, or several fused along out_features
            w = [n + ".weight" for n in names]
            q = QuantizedWeight.cat([quantized.get(n) for n in w]) if quantized else None
            return Linear(backend, _cat(params, w), _cat(params, [n + ".bias" for n in names]), q, "+".join(w))

        self.qkv = linear([attn + p for p in self.QKV])
        self.o_proj = linear([attn + "o_proj"])
        self.init_mlp(linear, params, mlp, cfg)
        self.input_norm = RMSNorm(backend, params[prefix + "input_layernorm.weight"], eps)
        self.post_norm = RMSNorm(backend, params[prefix + "post_attention_layernorm.weight"], eps)

    def __call__(self, h: torch.Tensor, residual: torch.Tensor | None, meta: StepMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """h: [N, H] the previous layer's output; residual: [N, H] or None (first layer)."""
        n, d = h.shape[0], self.head_dim
        x, residual = self.input_norm(h, residual)
        qkv = self.qkv(x)  # [N, (heads + 2 kv_heads) * D]
        k_end = (self.heads + self.kv_heads) * d
        qk = self.rotary(self.qk_heads(qkv, n), meta.positions)  # q and k heads side by side
        q, k = qk[:, : self.heads], qk[:, self.heads :]
        v = qkv[:, k_end:].view(n, self.kv_heads, d)
        o = self.backend.forward(self.index, q, k, v, meta, self.scale)  # [N, heads * D]
        x, residual = self.post_norm(self.o_proj(o), residual)
        return self.mlp(x), residual

    def init_mlp(self, linear, params: dict[str, torch.Tensor], prefix: str, cfg) -> None:
        """The feed-forward's weights (``prefix``: "model.layers.{i}.mlp."); ``linear(names)``
        fuses the named projections into one Linear."""
        self.gate_up = linear([prefix + p for p in self.GATE_UP])
        self.down = linear([prefix + "down_proj"])

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        """x: [N, H] -> the feed-forward's output [N, H]."""
        return self.down(self.backend.silu_mul(self.gate_up(x)))  # fused gate-up: [N, 2 I]

    def linears(self) -> list[Linear]:
        """Every linear layer, in the order a step reads them."""
        return [self.qkv, self.o_proj, self.gate_up, self.down]


    def qk_heads(self, qkv: torch.Tensor, n: int) -> torch.Tensor:
        """qkv: [N, (heads + 2 kv_heads) * D] -> the q and k heads before rotary, [N, heads + kv_heads, D]
        (a view here; a family that normalizes them returns a new tensor)."""
        return qkv[:, : (self.heads + self.kv_heads) * self.head_dim].view(n, self.heads + self.kv_heads, self.head_dim)


class LlamaForCausalLM:
    """pdserve's model for ``LlamaForCausalLM`` and ``Qwen2ForCausalLM`` checkpoints."""

    layer_class = DecoderLayer
    fusable = True  # the cpu backend's one-call decoder (cpu/decoder.c) computes exactly these layers

    def __init__(self, hf_model: torch.nn.Module, backend: Backend, max_positions: int, quantized: dict[str, QuantizedWeight] | None = None):
        """hf_model: the loaded transformers model (weights, config, rotary table);
        max_positions: the longest sequence the engine serves (the rotary table's length);
        quantized: the same weights in GGUF blocks by HF parameter name, for the linear
        layers to read in place where the backend takes them (all decoder layers' or none,
        as one fused call runs them; the LM head on its own)."""
        cfg = hf_model.config
        self.config, self.backend = cfg, backend
        self.dtype = hf_model.dtype
        self.device = next(hf_model.parameters()).device
        params = dict(hf_model.named_parameters(remove_duplicate=False))
        hf_inner = hf_model.get_decoder()
        cos, sin = rotary_tables(hf_inner.rotary_emb, max(max_positions, 1), self.device)
        rotary = Rotary(backend, cos, sin)
        quantized = quantized or {}
        embed = params["model.embed_tokens.weight"]
        self.embed = Embedding(embed, quantized.get("model.embed_tokens.weight"))
        self.layers = [self.layer_class(backend, params, f"model.layers.{i}.", i, cfg, rotary, quantized) for i in range(cfg.num_hidden_layers)]
        linears = [lin for layer in self.layers for lin in layer.linears()]
        if 0 < sum(lin.quantized for lin in linears) < len(linears):
            log.warning("quantized weights for %d of %d decoder linear layers: all dense", sum(lin.quantized for lin in linears), len(linears))
            for lin in linears:
                lin.to_dense()
        self.norm = RMSNorm(backend, params["model.norm.weight"], cfg.rms_norm_eps)
        self.lm_head = Linear(backend, params.get("lm_head.weight", embed), quantized=quantized.get("lm_head.weight"), name="lm_head.weight")
        every = (*linears, self.lm_head)  # in the order a step reads them
        for lin in every:  # what computes from blocks keeps no dense copy (the model's RSS)
            lin.drop_dense()
        for lin, packed in zip(every, backend.arrange([lin.packed for lin in every])):
            lin.packed = packed
        self.quantized = {"layers": linears[0].quantized if linears else False, "lm_head": self.lm_head.quantized,
                          "embedding": self.embed.quantized}
        self.fused = backend.fuse_layers(self.layers) if self.fusable else None  # all layers in one backend call, or None

    @torch.inference_mode()
    def forward(self, meta: StepMetadata) -> torch.Tensor:
        """One step over ``meta``'s N new tokens. Returns logits [S, vocab] float32 at each
        sequence's last new token."""
        h, residual = self.embed(meta.input_ids), None  # [N, H]
        if self.fused is not None and not meta.kv_progress:  # layer-wise streaming marks each layer: not fused
            h, residual = self.fused(h, meta)
        else:
            for layer in self.layers:
                h, residual = layer(h, residual, meta)
        last = meta.last_token_index
        x, _ = self.norm(h[last], residual[last])  # [S, H] (indexing copies): only the rows that sample
        return self.lm_head(x).float()  # [S, vocab]
