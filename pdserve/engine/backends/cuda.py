"""The ``cuda`` backend: the torch ops batched over the whole step, attention paged in place.

Linear layers, norms, rotary and activation are the torch backend's formulas over all of the
step's tokens at once. Attention, windowed and soft-capped attention included, is
FlexAttention over the KV pool itself (flex_paged.py): each sequence's block table is its
row of the step's block mask, so no context is gathered or copied, and no step loops over
its sequences. The mask is built once per step and window from tensors (block tables,
context lengths, positions), so a CUDA graph (cuda_graphs.py) records it with the forward
and rebuilds it from the graph's static inputs at every replay.

Latent attention (DeepSeek-V2) is the base class's torch rows: its latent spans the k and v
pools, and FlexAttention reads one key tensor.

FlashInfer is not wired. Batch invariance is a CPU rule: GPU sums follow cuBLAS and Triton.

The unit tests run this code on the CPU device (backends.TEST_CUDA_ON_CPU_ENV,
tests/unit/test_cuda_backend_cpu.py): FlexAttention runs eagerly there, and greedy ids
equal model.generate's in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.engine.backends.base import StepMetadata
from pdserve.engine.backends.flex_paged import PagedMask, attend, check_block_size
from pdserve.engine.backends.torch_sdpa import TorchBackend, rms_norm, rope


class CudaBackend(TorchBackend):
    name = "cuda"
    windowed_kernels = True

    def __init__(self, kv_cache, num_threads: int = 1):
        check_block_size(kv_cache.block_size, kv_cache.device)  # raises ValueError on a GPU
        super().__init__(kv_cache, num_threads)

    def prepare_extra(self, meta: StepMetadata) -> None:
        meta.extra["context_lens"] = torch.tensor(meta.context_lens, dtype=torch.long, device=self.device)  # [S]
        meta.extra["paged"] = {}  # window (None: whole context) -> PagedMask, built at its first layer

    def paged_mask(self, meta: StepMetadata, window: int | None) -> PagedMask:
        """The step's block mask for ``window``, built at the first layer that asks."""
        masks = meta.extra["paged"]
        if window not in masks:
            bs = self.kv_cache.block_size
            masks[window] = PagedMask.build(meta.block_tables, meta.extra["context_lens"], meta.token_seq, meta.positions,
                                            self.kv_cache.k.shape[2] // bs, bs, meta.decode_only, window)
        return masks[window]

    def forward(self, layer, q, k, v, meta: StepMetadata, scale):
        self.store_kv(layer, k, v, meta)
        return attend(q, self.kv_cache.k[layer], self.kv_cache.v[layer], self.paged_mask(meta, None), scale)

    def forward_windowed(self, layer, q, k, v, meta: StepMetadata, scale, window, softcap):
        self.store_kv(layer, k, v, meta)
        return attend(q, self.kv_cache.k[layer], self.kv_cache.v[layer], self.paged_mask(meta, window), scale, softcap)

    def linear(self, x, packed, out_features, bias):
        return F.linear(x, packed, bias)

    def add_rmsnorm(self, x, residual, weight, eps):
        residual = x.clone() if residual is None else residual + x
        return rms_norm(residual, weight, eps), residual

    def rope_(self, x, positions, cos, sin):
        return rope(x, positions, cos, sin)
