"""Pre-packed oneDNN weights for the model's linear layers (CPU, bfloat16).

transformers' ``nn.Linear`` calls ``F.linear``, which on this CPU runs bf16 GEMV (one
token per sequence, the decode case) at 7-16 GB/s. The same matmul against a weight
reordered once into oneDNN's blocked layout (``torch.ops.mkldnn._reorder_linear_weight``,
what torch.compile's CPU freezing path uses) runs 1.3-3x faster for 1-8 rows and the
same for prefill-sized batches, with bit-identical results (measured in bench/ and
checked in tests/test_engine.py). Only each layer's ``forward`` is swapped; the module
tree and the original weights stay transformers'.
"""

from __future__ import annotations

import types

import torch


def can_pack(model) -> bool:
    device = next(model.parameters()).device
    return (
        device.type == "cpu"
        and model.dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def _packed_forward(self, x: torch.Tensor) -> torch.Tensor:
    # x: [..., in_features] -> [..., out_features]
    rows = x.reshape(-1, x.shape[-1])
    out = torch.ops.mkldnn._linear_pointwise(rows, self._packed_weight, self.bias, "none", [None], "")
    return out.view(*x.shape[:-1], out.shape[-1])


def pack_linears(model) -> int:
    """Swap every ``nn.Linear`` of ``model`` to a packed-weight forward; returns how many."""
    count = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and not hasattr(module, "_packed_weight"):
            module._packed_weight = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), 1)
            module.forward = types.MethodType(_packed_forward, module)
            count += 1
    return count
