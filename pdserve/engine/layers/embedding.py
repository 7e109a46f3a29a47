"""Embedding: token ids -> rows of the embedding table, dense or read from GGUF blocks.

A decode pool that reads its linear layers' blocks (engine/quantized.py) looks its tokens
up in the table's blocks too, so it keeps no dense copy of the model: the bundled model's
Q8_0 table is 30 MB, against 113 MB in float32. A row is de-quantized as gguf-py does
(``gguf.quants``: Q8_0 ``d * q``, Q4_0 ``d * (q - 8)``, Q4_1 ``d * q + m``, all in float32,
``d`` and ``m`` stored as float16, each block's low nibbles its first 16 weights), then cast
to the model's dtype as transformers' loader casts the de-quantized table, so a row has the
dense table's bits (checked for the whole table at load).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from pdserve.engine.quantized import QuantizedWeight

log = logging.getLogger(__name__)

BLOCK_BYTES = {2: 18, 3: 20, 8: 34}  # ggml_type (Q4_0, Q4_1, Q8_0) -> bytes per block


def dequantize_rows(ggml_type: int, rows: torch.Tensor) -> torch.Tensor:
    """rows: [M, row bytes] uint8, whole rows of a Q4_0, Q4_1 or Q8_0 tensor as stored.
    Returns [M, row bytes / block bytes * 32] float32. Raises ValueError for another type."""
    if ggml_type not in BLOCK_BYTES:
        raise ValueError(f"no row de-quantization for GGUF type {ggml_type} (takes {sorted(BLOCK_BYTES)})")
    m = rows.shape[0]
    b = rows.reshape(m, -1, BLOCK_BYTES[ggml_type])  # [M, blocks, block bytes]
    d = b[..., 0:2].contiguous().view(torch.float16).float()  # [M, blocks, 1]
    if ggml_type == 8:
        w = d * b[..., 2:].contiguous().view(torch.int8).float()
    else:
        start = 2 if ggml_type == 2 else 4
        nib = b[..., start:]  # [M, blocks, 16]: weight i in the low nibble, i + 16 in the high
        q = torch.cat([nib & 0x0F, nib >> 4], dim=-1).float()  # [M, blocks, 32]
        w = d * (q - 8) if ggml_type == 2 else d * q + b[..., 2:4].contiguous().view(torch.float16).float()
    return w.reshape(m, -1)


class Embedding:
    def __init__(self, weight: torch.Tensor, quantized: QuantizedWeight | None = None):
        """weight: [vocab, H] the model's dense table; quantized: the same table in GGUF
        blocks, used (and ``weight`` dropped) when its rows de-quantize to ``weight``'s bits
        in its dtype; otherwise the dense table, with a warning."""
        self.vocab, self.hidden = weight.shape
        self.dtype = weight.dtype
        self.ggml_type = quantized.ggml_type if quantized is not None else None
        self.blocks = self._check(quantized, weight.detach()) if quantized is not None else None
        self.quantized = self.blocks is not None
        self.weight = None if self.quantized else weight.detach()

    def _check(self, q: QuantizedWeight, weight: torch.Tensor) -> torch.Tensor | None:
        if q.ggml_type not in BLOCK_BYTES or (q.out_features, q.in_features) != (self.vocab, self.hidden) or weight.device.type != "cpu":
            log.info("embedding: GGUF type %d [%d, %d] not read in place: dense table", q.ggml_type, q.out_features, q.in_features)
            return None
        as_int = {torch.float32: torch.int32, torch.bfloat16: torch.int16}.get(self.dtype)
        values = dequantize_rows(q.ggml_type, q.data).to(self.dtype)
        if as_int is None or not torch.equal(values.view(as_int), weight.contiguous().view(as_int)):
            log.warning("embedding: its GGUF blocks de-quantize to other values than the model's table: dense")
            return None
        return q.data

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: [N] int64 -> [N, H] in the model's dtype."""
        if self.blocks is None:
            return F.embedding(ids, self.weight)
        return dequantize_rows(self.ggml_type, self.blocks[ids]).to(self.dtype)
