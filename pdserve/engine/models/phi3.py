"""Phi-3 (``Phi3ForCausalLM``): the Llama layer over checkpoints that store QKV and gate-up
already fused (``self_attn.qkv_proj``: [(heads + 2 kv_heads) * D, H]; ``mlp.gate_up_proj``:
[2 I, H], gate first, as HF ``Phi3MLP`` chunks it). ``longrope`` (Phi-3's 128k models) takes
layers/rotary.py's LongRopeRotary (op by op: the fused decoder has one table); a partial
rotary is refused by ``check_supported``.
"""

from __future__ import annotations

from pdserve.engine.models.llama import DecoderLayer, LlamaForCausalLM


class Phi3DecoderLayer(DecoderLayer):
    QKV = ("qkv_proj",)
    GATE_UP = ("gate_up_proj",)


class Phi3ForCausalLM(LlamaForCausalLM):
    """pdserve's model for ``Phi3ForCausalLM`` checkpoints."""

    layer_class = Phi3DecoderLayer
