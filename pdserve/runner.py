"""ModelRunner: the HF model forward used by both worker pools.

The architecture (layers, rotary, norms, MLP) is transformers'; this class only
decides what goes into each forward and what comes out. Calls mirror
``model.generate`` (same inputs, ``logits_to_keep=1``) so that greedy outputs
are bit-identical to the single-process reference in float32.
"""

from __future__ import annotations

import inspect
import threading

import torch
from transformers import DynamicCache

from pdserve.kv_layout import KVSpec, cache_to_kv, kv_to_cache


class ModelRunner:
    """Runs prefill and decode forwards of one causal LM, one sequence at a time.

    Thread-safe: forwards are serialized by a lock, since the model owns all the
    worker's torch threads.
    """

    def __init__(self, model, eos_token_ids: frozenset[int], max_model_len: int):
        self.model = model
        self.config = model.config
        self.device = next(model.parameters()).device
        self.kv_spec = KVSpec.from_model_config(model.config, model.dtype)
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self._lock = threading.Lock()
        # transformers >= 5.24 renamed the forward's `past_key_values` to `cache`.
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self.num_forwards = 0

    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward the whole prompt.

        Returns (logits: [vocab] float32 of the last position,
        kv: [num_layers, 2, kv_heads, len(prompt_ids), head_dim]).
        """
        input_ids = torch.tensor([prompt_ids], device=self.device)  # [1, T]
        cache = DynamicCache(config=self.config)
        with self._lock:
            out = self.model(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                **{self._cache_kwarg: cache},
                cache_position=torch.arange(len(prompt_ids), device=self.device),
                use_cache=True,
                logits_to_keep=1,
            )
            self.num_forwards += 1
        return out.logits[0, -1].float(), cache_to_kv(cache)

    def cache_from_kv(self, kv: torch.Tensor) -> DynamicCache:
        """Wrap received ``kv: [num_layers, 2, kv_heads, tokens, head_dim]`` as a cache to decode from."""
        return kv_to_cache(kv.to(self.device), self.config)

    @torch.inference_mode()
    def decode(self, cache: DynamicCache, token_id: int) -> torch.Tensor:
        """Append ``token_id`` after the cache's tokens; return next-token logits [vocab] float32.

        The cache grows by one token in place.
        """
        position = cache.get_seq_length()
        input_ids = torch.tensor([[token_id]], device=self.device)  # [1, 1]
        with self._lock:
            out = self.model(
                input_ids=input_ids,
                attention_mask=torch.ones((1, position + 1), dtype=torch.long, device=self.device),
                **{self._cache_kwarg: cache},
                cache_position=torch.tensor([position], device=self.device),
                use_cache=True,
                logits_to_keep=1,
            )
            self.num_forwards += 1
        return out.logits[0, -1].float()
