"""The ``cpu`` backend: pdserve's C kernels (engine/cpu/), batch invariant by construction.

Linear layers run on weights packed once (linear.c), the norm, rotary and activation are
fused row ops (pointwise.c), and attention reads the pool in place through the block
tables (attention.c), one algorithm for prompt chunks and decode tokens. Each kernel passed
its start-up self-check (``cpu.ops.available``) or the backend is not offered; where a
kernel is missing, ``backends.select`` falls back to ``torch`` for the whole step, so a
step never mixes two numerics.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from pdserve.engine.backends.base import Backend, StepMetadata
from pdserve.engine.quantized import QuantizedWeight
from pdserve.engine import cpu, huge_pages
from pdserve.engine.cpu import ops


def supported(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether every kernel built here and passed its self-check, for this dtype and device."""
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and all(ops.available(k) for k in ops.KERNELS)


class CpuBackend(Backend):
    name = "cpu"

    @contextmanager
    def step_scope(self):
        """torch's own ops in a step (embedding, indexing, sampling) on this thread alone. The
        kernels split their work on their own pool of ``num_threads``; torch's OpenMP workers,
        left spinning after each of its parallel regions, took the cores those need (decode at
        batch 16 on 2 threads, AVX512-BF16 EPYC: 39.0 ms a step without this scope, 24.0 with)."""
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(threads)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: StepMetadata, scale: float) -> torch.Tensor:
        out = ops.paged_attention(q, self.kv_cache.k[layer], self.kv_cache.v[layer], meta.block_tables, meta.token_seq, meta.positions,
                                  self.kv_cache.block_size, scale, self.num_threads, k_new=k, v_new=v, slots=meta.slot_mapping)
        self.mark_stored(layer, meta)  # the kernel stored k, v first
        return out

    windowed_kernels = True

    def forward_windowed(self, layer, q, k, v, meta, scale, window, softcap):
        """In the attention kernel (cpu/attention.c): a row starts at the key tile holding its
        window's first key."""
        out = ops.paged_attention(q, self.kv_cache.k[layer], self.kv_cache.v[layer], meta.block_tables, meta.token_seq, meta.positions,
                                  self.kv_cache.block_size, scale, self.num_threads, k_new=k, v_new=v, slots=meta.slot_mapping,
                                  window=window, softcap=softcap)
        self.mark_stored(layer, meta)
        return out

    def fuse_layers(self, layers):
        """The layers as one C call per step (cpu/decoder.c), where it built."""
        if cpu.load("decoder") is None or not layers:
            return None
        first = layers[0]
        decoder = ops.Decoder(
            [{"w_qkv": l.qkv.packed, "b_qkv": l.qkv.bias, "w_o": l.o_proj.packed, "b_o": l.o_proj.bias, "w_gu": l.gate_up.packed,
              "b_gu": l.gate_up.bias, "w_down": l.down.packed, "b_down": l.down.bias, "norm_in": l.input_norm.weight,
              "norm_post": l.post_norm.weight, "k": self.kv_cache.k[l.index], "v": self.kv_cache.v[l.index]} for l in layers],
            hidden=first.qkv.in_features, heads=first.heads, kv_heads=first.kv_heads, head_dim=first.head_dim,
            intermediate=first.down.in_features, block_size=self.kv_cache.block_size, eps=first.input_norm.eps, scale=first.scale,
            cos=first.rotary.cos, sin=first.rotary.sin, dtype=first.input_norm.weight.dtype, num_threads=self.num_threads,
            quantized=first.qkv.quantized, allreduce=self.allreduce_hook)

        def run(h: torch.Tensor, meta: StepMetadata) -> tuple[torch.Tensor, torch.Tensor]:
            return decoder(h, meta.positions, meta.slot_mapping, meta.token_seq, meta.block_tables)

        return run

    pack_copies = True
    _arena: huge_pages.Arena | None = None  # while loading
    _loaded: huge_pages.Arena | None = None  # the last load's

    @contextmanager
    def loading(self, capacity: int):
        """Packed weights go straight into one reserved run of huge pages (huge_pages.Arena),
        in the order packed: the run ``arrange`` would copy them into, with no second copy."""
        self._arena = arena = huge_pages.Arena(capacity)
        try:
            yield
        finally:
            self._arena = None
            self._loaded = arena

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        return ops.pack(weight, self._arena.take if self._arena is not None else None)

    def arrange(self, packed: list[torch.Tensor]) -> list[torch.Tensor]:
        """One run of huge pages, in step order (huge_pages.gather: a decode step streams them);
        as they are where ``loading`` placed them all in one already."""
        if self._loaded is not None and all(self._loaded.holds(t) for t in packed):
            return packed
        self._loaded = None  # (the arena lives on only through packed weights still in it)
        return huge_pages.gather(packed)

    def discard(self, packed: torch.Tensor) -> None:
        if self._arena is not None:
            self._arena.give_back(packed)

    def linear(self, x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
        return ops.linear(x, packed, out_features, bias, self.num_threads)

    def pack_quantized(self, weight: QuantizedWeight) -> torch.Tensor | None:
        if not ops.quantized_ok(self.kv_cache.spec.dtype) or not ops.qpack_ok(weight.ggml_type, weight.out_features, weight.in_features):
            return None
        return ops.qpack(weight.ggml_type, weight.data, weight.out_features, weight.in_features,
                         self._arena.take if self._arena is not None else None)

    def dequantize(self, packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
        return ops.qdequant(packed, out_features, in_features)

    def linear_quantized(self, x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
        return ops.qlinear(x, packed, out_features, bias, self.num_threads)

    def add_rmsnorm(self, x, residual, weight, eps):
        if residual is None:
            residual = torch.empty_like(x)
            return ops.add_rmsnorm(x, residual, False, weight, eps, self.num_threads), residual
        return ops.add_rmsnorm(x, residual, True, weight, eps, self.num_threads), residual

    def rope_(self, x, positions, cos, sin):
        ops.rope_(x, positions, cos, sin, self.num_threads)
        return x

    def mask_logits_(self, row, mask):
        """A grammar's mask on ``row: [vocab]`` float32 logits, in place (sampler.py): the C loop."""
        return ops.mask_logits_(row, mask)

    def silu_mul(self, gate_up):
        return ops.silu_mul(gate_up, self.num_threads)
