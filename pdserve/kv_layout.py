"""KV-cache shape of one model, shared by both workers, the engine and the transfer layer.

Engines keep KV in a paged pool (``pdserve/engine/kv_cache.py``); transfers move
it per layer in token-major chunks ``[num_tokens, kv_heads, head_dim]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVSpec:
    """Shape and dtype of one model's KV cache."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def from_model_config(cls, config, dtype: torch.dtype) -> "KVSpec":
        """The KV of ``config``'s model: its KV heads, or for multi-head latent attention
        (a ``kv_lora_rank``: DeepSeek-V2) its latent per token and layer, kv_lora_rank +
        qk_rope_head_dim elements, as one KV head whose k and v hold its two halves
        (backends/base.py ``forward_latent``), so every transport and checksum moves the
        latent as it moves K and V."""
        text = config.get_text_config(decoder=True)
        if getattr(text, "kv_lora_rank", None):
            return cls(text.num_hidden_layers, 1, -(-(text.kv_lora_rank + text.qk_rope_head_dim) // 2), dtype)
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        num_kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        return cls(text.num_hidden_layers, num_kv_heads, head_dim, dtype)

    @property
    def bytes_per_token(self) -> int:
        """Bytes of key + value for one token over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize
