"""KV-cache layout shared by the prefill and decode workers and the transfer layer.

One request's prompt KV travels and is held as a single tensor::

    kv: [num_layers, 2, num_kv_heads, num_tokens, head_dim]   # 2 = (key, value)

which is transformers' per-layer cache layout ``[batch=1, kv_heads, tokens,
head_dim]`` stacked over layers, with batch dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache


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

    def shape(self, num_tokens: int) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.num_kv_heads, num_tokens, self.head_dim)


def cache_to_kv(cache: DynamicCache) -> torch.Tensor:
    """Stack a batch-1 DynamicCache into ``kv: [num_layers, 2, kv_heads, tokens, head_dim]``."""
    # each layer: keys/values [1, kv_heads, tokens, head_dim]
    return torch.stack([torch.stack([layer.keys[0], layer.values[0]]) for layer in cache.layers])


def kv_to_cache(kv: torch.Tensor, model_config) -> DynamicCache:
    """Build a batch-1 DynamicCache holding ``kv: [num_layers, 2, kv_heads, tokens, head_dim]``."""
    cache = DynamicCache(config=model_config)
    for layer_idx in range(kv.shape[0]):
        cache.update(kv[layer_idx, 0].unsqueeze(0), kv[layer_idx, 1].unsqueeze(0), layer_idx)
    return cache
