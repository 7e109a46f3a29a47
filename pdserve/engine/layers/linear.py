"""Linear: y = x @ W^T (+ b), its weight packed once in the backend's form, dense or quantized."""

from __future__ import annotations

import logging

import torch

from pdserve.engine.backends.base import Backend
from pdserve.engine.quantized import QuantizedWeight

log = logging.getLogger(__name__)


class Linear:
    def __init__(self, backend: Backend, weight: torch.Tensor, bias: torch.Tensor | None = None, quantized: QuantizedWeight | None = None,
                 name: str = ""):
        """weight: [out_features, in_features], the dense weight (the model's); bias:
        [out_features] or None. Fused layers (QKV, gate-up) pass their weights concatenated
        along out_features. quantized: the same weight in GGUF blocks, used where the backend
        computes with them and their de-quantized values equal ``weight`` bit for bit in its
        dtype (checked here; else the dense weight, with a warning naming the layer). Where the
        backend packs a copy of a dense weight, ``self.weight`` is dropped (None)."""
        self.backend, self.weight, self.name = backend, weight.detach(), name
        self.after = None  # tensor parallel: what takes the output (an all-reduce, a gather; tensor_parallel/rank_model.py)
        self.out_features, self.in_features = weight.shape
        self.bias = bias.detach().contiguous() if bias is not None else None
        self.packed = self._pack_quantized(quantized) if quantized is not None else None
        self.quantized = self.packed is not None
        if not self.quantized:
            self.packed = backend.pack(self.weight)
            if self.packed.data_ptr() != self.weight.data_ptr():  # a packed copy: the dense weight goes (one copy kept)
                self.weight = None

    def _pack_quantized(self, q: QuantizedWeight):
        if (q.out_features, q.in_features) != (self.out_features, self.in_features):
            log.warning("%s: GGUF blocks are [%d, %d], the weight [%d, %d]: dense", self.name, q.out_features, q.in_features,
                        self.out_features, self.in_features)
            return None
        packed = self.backend.pack_quantized(q)
        if packed is None:
            return None
        values = self.backend.dequantize(packed, self.out_features, self.in_features).to(self.weight.dtype)
        as_int = {torch.float32: torch.int32, torch.bfloat16: torch.int16}.get(self.weight.dtype)
        if as_int is None or not torch.equal(values.view(as_int), self.weight.contiguous().view(as_int)):
            log.warning("%s: its GGUF blocks de-quantize to other values than the model's weight: dense", self.name)
            self.backend.discard(packed)
            return None
        return packed

    def to_dense(self) -> None:
        """Compute with the dense weight from now on. Raises RuntimeError after ``drop_dense``."""
        if self.quantized:
            if self.weight is None:
                raise RuntimeError(f"{self.name}: its dense weight was dropped")
            self.packed, self.quantized = self.backend.pack(self.weight), False

    def drop_dense(self) -> None:
        """A quantized layer lets its dense weight go (its blocks are what it computes with)."""
        if self.quantized:
            self.weight = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [M, in_features] -> [M, out_features]."""
        run = self.backend.linear_quantized if self.quantized else self.backend.linear
        y = run(x, self.packed, self.out_features, self.bias)
        return y if self.after is None else self.after(y.contiguous())
