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

The weights come from a Checkpoint (engine/checkpoint.py): read from the safetensors files
straight into the fused layers (HF directories and converted GGUFs alike), or taken from a
loaded transformers model, whose modules are not called. Shapes follow the config: Qwen2 adds biases to the
QKV projection, Llama may (``attention_bias``, ``mlp_bias``); both tie or untie lm_head.
"""

from __future__ import annotations

import functools
import logging

import torch

from pdserve.engine.backends.base import Backend, StepMetadata
from pdserve.engine.checkpoint import Checkpoint, CheckpointError
from pdserve.engine.layers import Embedding, Linear, RMSNorm, Rotary
from pdserve.engine.layers.rotary import LongRopeRotary, rotary_tables
from pdserve.engine.models.config import layer_window, rope_parameters
from pdserve.engine.quantized import QuantizedWeight

log = logging.getLogger(__name__)


def fused_linear(backend: Backend, params: Checkpoint, quantized: dict[str, QuantizedWeight], names: list[str]) -> Linear:
    """One projection of the checkpoint (``names``: parameter names without ``.weight``), or
    several fused along out_features, with their biases where the checkpoint has them.
    Raises CheckpointError where it has none of them."""
    w = [n + ".weight" for n in names]
    q = QuantizedWeight.cat([quantized.get(n) for n in w]) if quantized else None
    weight = params.cat(w, transient=backend.pack_copies and q is None)  # packed as a copy: read into a reused buffer
    if weight is None:
        raise CheckpointError(f"the checkpoint has none of {', '.join(w)}")
    return Linear(backend, weight, params.cat([n + ".bias" for n in names]), q, "+".join(w))


class DecoderLayer:
    # the checkpoint's projections fused into one linear layer each, in this order
    QKV = ("q_proj", "k_proj", "v_proj")
    GATE_UP = ("gate_proj", "up_proj")

    def __init__(self, backend: Backend, params: Checkpoint, prefix: str, index: int, cfg, rotary: Rotary,
                 quantized: dict[str, QuantizedWeight]):
        self.backend, self.index, self.rotary = backend, index, rotary
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.scale = self.head_dim ** -0.5
        self.window = layer_window(cfg, index)  # tokens, or None: full attention (LlamaForCausalLM drops one >= the context)
        self.softcap = None  # attention-logit soft-capping (Gemma 2)
        eps = cfg.rms_norm_eps
        attn, mlp = prefix + "self_attn.", prefix + "mlp."
        linear = functools.partial(fused_linear, backend, params, quantized)
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
        qk = self.rotary(self.qk_heads(qkv, n), meta)  # q and k heads side by side
        q, k = qk[:, : self.heads], qk[:, self.heads :]
        v = qkv[:, k_end:].view(n, self.kv_heads, d)
        o = self.attend(q, k, v, meta)  # [N, heads * D]
        x, residual = self.post_norm(self.o_proj(o), residual)
        return self.mlp(x), residual

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: StepMetadata) -> torch.Tensor:
        """Store k, v and attend (the backend's ``forward_windowed`` where this layer has a
        sliding window or soft-capping): q [N, heads, D] -> [N, heads * D]."""
        if self.window is None and self.softcap is None:
            return self.backend.forward(self.index, q, k, v, meta, self.scale)
        return self.backend.forward_windowed(self.index, q, k, v, meta, self.scale, self.window, self.softcap)

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
    activations = ("silu",)  # the feed-forward's, as HF configs name them (check_supported)
    fusable = True  # the cpu backend's one-call decoder (cpu/decoder.c) computes exactly these layers

    def __init__(self, checkpoint: Checkpoint, backend: Backend, max_positions: int, quantized: dict[str, QuantizedWeight] | None = None):
        """checkpoint: the weights, config and rotary table (engine/checkpoint.py: read from
        safetensors, or a loaded transformers model's); max_positions: the longest sequence
        the engine serves (the rotary table's length); quantized: the same weights in GGUF
        blocks by HF parameter name, for the linear layers to read in place where the backend
        takes them (all decoder layers' or none, as one fused call runs them; the LM head on
        its own). Raises CheckpointError for a tensor the checkpoint lacks."""
        cfg = checkpoint.config
        self.config, self.backend = cfg, backend
        self.dtype, self.device = checkpoint.dtype, checkpoint.device
        params = checkpoint
        rotary = self.make_rotary(checkpoint, backend, max_positions)
        quantized = quantized or {}
        embed = params["model.embed_tokens.weight"]
        self.embed = Embedding(embed, quantized.get("model.embed_tokens.weight"))
        with backend.loading(checkpoint.nbytes() * 9 // 8 + (64 << 20)):  # packed weights straight into their place (a bound)
            self.layers = [self.layer_class(backend, params, f"model.layers.{i}.", i, cfg, rotary, quantized) for i in range(cfg.num_hidden_layers)]
            linears = [lin for layer in self.layers for lin in layer.linears()]
            if 0 < sum(lin.quantized for lin in linears) < len(linears):
                log.warning("quantized weights for %d of %d decoder linear layers: all dense", sum(lin.quantized for lin in linears), len(linears))
                for lin in linears:
                    lin.to_dense()
            self.norm = RMSNorm(backend, params["model.norm.weight"], cfg.rms_norm_eps)
            lm_head = params.cat(["lm_head.weight"], transient=backend.pack_copies and quantized.get("lm_head.weight") is None)
            self.lm_head = Linear(backend, lm_head if lm_head is not None else embed, quantized=quantized.get("lm_head.weight"), name="lm_head.weight")
        every = (*linears, self.lm_head)  # in the order a step reads them
        for lin in every:  # what computes from blocks keeps no dense copy (the model's RSS)
            lin.drop_dense()
        for lin, packed in zip(every, backend.arrange([lin.packed for lin in every])):
            lin.packed = packed
        self.quantized = {"layers": linears[0].quantized if linears else False, "lm_head": self.lm_head.quantized,
                          "embedding": self.embed.quantized}
        for layer in self.layers:
            if layer.window is not None and layer.window >= max_positions:  # spans the whole context: full attention
                layer.window = None
        windows = {layer.window for layer in self.layers}
        self.kv_window = windows.pop() if len(windows) == 1 else None  # every layer's window, where they share one (Engine.free_outside_window)
        windowed = sorted({what for layer in self.layers for what, on in (("a sliding window", layer.window), ("logit soft-capping", layer.softcap))
                           if on is not None})
        torch_rows = [] if backend.windowed_kernels else windowed
        if torch_rows:
            log.info("%s: attention with %s runs in torch ops row by row (backends/base.py forward_windowed: the %s backend's "
                     "attention kernels have neither); the rest on that backend", type(self).__name__, " and ".join(torch_rows), backend.name)
        self.torch_rows = torch_rows  # what runs in forward_windowed's torch rows
        # why decode steps cannot replay CUDA graphs: Python over the step's lists
        self.no_graphs = [f"attention with {what} runs in torch rows" for what in torch_rows]
        self.rope_switch = rotary.original if isinstance(rotary, LongRopeRotary) else None  # longrope's (Engine.switch_rope_tables)
        if self.rope_switch is not None:
            self.no_graphs.append("longrope picks each sequence's table by its length")
        # the fused decoder (cpu/decoder.c) has no windows, soft-caps or per-token tables
        fusable = self.fusable and not windowed and not isinstance(rotary, LongRopeRotary)
        self.fused = backend.fuse_layers(self.layers) if fusable else None  # all layers in one backend call, or None

    @classmethod
    def check_config(cls, config) -> None:
        """Raises ``UnsupportedModelError`` (models/config.py) for a feature of ``config`` that this
        family's code does not implement (default: none beyond the registry's checks)."""

    def make_rotary(self, checkpoint: Checkpoint, backend: Backend, max_positions: int) -> Rotary:
        """The rotary every layer takes: HF's table at positions 0 .. max_positions - 1 (for
        ``longrope``, its short and long tables)."""
        hf, params = checkpoint.rotary_emb(), rope_parameters(checkpoint.config)
        if (params.get("rope_type") or params.get("type")) == "longrope":
            original = params.get("original_max_position_embeddings") or checkpoint.config.original_max_position_embeddings
            short = rotary_tables(hf, original, self.device)  # HF's forward over positions < original: the short factors
            return LongRopeRotary(backend, short, rotary_tables(hf, max(max_positions, original + 1), self.device), original)
        return Rotary(backend, *rotary_tables(hf, max(max_positions, 1), self.device))

    def weight_bytes(self) -> int:
        """Bytes of the weights this model keeps: packed linear layers and their biases, the
        embedding table (dense or blocks) and the norms."""
        seen: dict[int, int] = {}

        def add(t):
            if isinstance(t, torch.Tensor):
                seen[t.data_ptr()] = max(seen.get(t.data_ptr(), 0), t.numel() * t.element_size())

        lins = [lin for layer in self.layers for lin in layer.linears()] + [self.lm_head]
        for lin in lins:
            add(lin.packed), add(lin.bias)
        add(self.embed.weight), add(self.embed.blocks), add(self.norm.weight)
        for layer in self.layers:
            for v in vars(layer).values():
                add(getattr(v, "weight", None) if isinstance(v, RMSNorm) else None)
        return sum(seen.values())

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
