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

from pdserve.engine import attention, exact_gemv


def can_pack(model) -> bool:
    """Whether ``pack_linears`` applies: a bf16 model on a CPU where oneDNN has a bf16 path.
    oneDNN's bf16 reorder needs AVX512 (BW, VL, DQ) or AVX-NE-CONVERT; on an AVX2-only CPU
    it raises, and the layers keep transformers' ``F.linear``."""
    device = next(model.parameters()).device
    return (
        device.type == "cpu"
        and model.dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and onednn_has_bf16()
    )


def onednn_has_bf16() -> bool:
    """oneDNN's bf16 kernels run on this CPU (torch's own check, else a probe reorder)."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    if check is not None:
        return bool(check())
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), 1)
    except RuntimeError:
        return False
    return True


def _onednn(self, rows: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(rows, self._packed_weight, self.bias, "none", [None], "")


def _packed_forward(self, x: torch.Tensor) -> torch.Tensor:
    # x: [..., in_features] -> [..., out_features]; runs for every linear layer of every step,
    # so the decode-row test reads plain attributes (~1 us) before anything else
    rows = x.reshape(-1, x.shape[-1])  # [M, in_features]
    pairs, ctx = self._gemv_pairs, attention.current_context()
    if pairs is not None and ctx is not None and ctx.gemv_rows is not None and rows.shape[0] == ctx.query_starts[-1]:
        num_gemv = ctx.gemv_rows.shape[0]
        if self._gemv_required or num_gemv <= exact_gemv.FEW_ROWS or torch.get_num_threads() == 1:
            out = (exact_gemv.gemv_rows(rows, pairs, self.out_features) if num_gemv == rows.shape[0]
                   else _split_rows(self, rows, ctx.gemv_rows))
            return out.view(*x.shape[:-1], self.out_features)
    out = _onednn(self, rows)
    return out.view(*x.shape[:-1], out.shape[-1])


def _split_rows(self, rows: torch.Tensor, gemv_rows: torch.Tensor) -> torch.Tensor:
    """Decode rows (``gemv_rows``, indices) summed as oneDNN sums a lone row (exact_gemv.py);
    the others by oneDNN's GEMM, as the reference's prompt forward computes them."""
    out = torch.empty(rows.shape[0], self.out_features, dtype=rows.dtype)
    out[gemv_rows] = exact_gemv.gemv_rows(rows[gemv_rows], self._gemv_pairs, self.out_features)
    keep = torch.ones(rows.shape[0], dtype=torch.bool)
    keep[gemv_rows] = False
    others = rows[keep]
    if len(others) == 1:  # oneDNN would take its GEMV path for one row: two rows keep the GEMM's sums
        out[keep] = _onednn(self, others.expand(2, -1).contiguous())[:1]
    else:
        out[keep] = _onednn(self, others)
    return out


def pack_linears(model) -> int:
    """Swap every ``nn.Linear`` of ``model`` to a packed-weight forward; returns how many."""
    count = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and not hasattr(module, "_packed_weight"):
            module._packed_weight = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), 1)
            module._gemv_pairs = None  # exact_gemv.prepare sets it where its kernel takes the decode rows
            module.forward = types.MethodType(_packed_forward, module)
            count += 1
    return count
