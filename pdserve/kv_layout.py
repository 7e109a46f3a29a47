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
        text = config.get_text_config(decoder=True)
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        num_kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        return cls(text.num_hidden_layers, num_kv_heads, head_dim, dtype)

    @property
    def bytes_per_token(self) -> int:
        """Bytes of key + value for one token over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize
