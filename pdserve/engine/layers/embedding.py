"""Embedding: token ids -> rows of the embedding table, dense or read from GGUF blocks.

A decode pool that reads its linear layers' blocks (engine/quantized.py) looks its tokens
up in the table's blocks too, so it keeps no dense copy of the model: the bundled model's
Q8_0 table is 30 MB, against 113 MB in float32. A row is de-quantized as gguf-py does
(``gguf.quants``: Q8_0 ``d * q``, Q4_0 ``d * (q - 8)``, Q4_1 ``d * q + m``, all in float32,
``d`` and ``m`` stored as float16, each block's low nibbles its first 16 weights; the
K-quants Q4_K ``(d * sc) * q - dmin * m`` and Q6_K ``(d * sc) * (q - 32)``), then cast
to the model's dtype as transformers' loader casts the de-quantized table, so a row has the
dense table's bits (checked for the whole table at load).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from pdserve.engine.quantized import QuantizedWeight

log = logging.getLogger(__name__)

BLOCK_BYTES = {2: 18, 3: 20, 8: 34, 12: 144, 14: 210}  # ggml_type (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K) -> bytes per block


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 -> [..., 1] float32: a stored float16."""
    return b.contiguous().view(torch.float16).float()


def _k_quant(ggml_type: int, b: torch.Tensor) -> torch.Tensor:
    """b: [M, super-blocks, bytes] of Q4_K or Q6_K -> [M, super-blocks, 256] float32, as
    gguf-py's ``Q4_K`` / ``Q6_K.dequantize_blocks`` (the same float32 operations in order)."""
    m, n = b.shape[:2]
    if ggml_type == 12:  # d, dmin f16; 12 bytes of 6-bit scales and mins; qs[128]
        s = b[..., 4:16].reshape(m, n, 3, 4)
        sd, sm, smd = s[..., 0, :], s[..., 1, :], s[..., 2, :]
        sc = torch.cat([sd & 0x3F, (smd & 0x0F) | ((sd >> 2) & 0x30)], dim=-1).float()  # [M, n, 8]
        mn = torch.cat([sm & 0x3F, (smd >> 4) | ((sm >> 2) & 0x30)], dim=-1).float()
        shifts = torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 1, 2, 1)
        q = ((b[..., 16:].reshape(m, n, 4, 1, 32) >> shifts) & 0x0F).reshape(m, n, 8, 32).float()
        return ((_f16(b[..., 0:2]) * sc).unsqueeze(-1) * q - (_f16(b[..., 2:4]) * mn).unsqueeze(-1)).reshape(m, n, 256)
    # Q6_K: ql[128] (low 4 bits), qh[64] (high 2), scales int8[16] (one per 16 weights), d f16
    lo = (b[..., :128].reshape(m, n, 2, 1, 64) >> torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 1, 2, 1)) & 0x0F
    hi = (b[..., 128:192].reshape(m, n, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 1, 4, 1)) & 0x03
    q = ((lo.reshape(m, n, 8, 32) | (hi.reshape(m, n, 8, 32) << 4)).to(torch.int8) - 32).float().reshape(m, n, 16, 16)
    d = _f16(b[..., 208:210]) * b[..., 192:208].contiguous().view(torch.int8).float()  # [M, n, 16]
    return (d.unsqueeze(-1) * q).reshape(m, n, 256)


def dequantize_rows(ggml_type: int, rows: torch.Tensor) -> torch.Tensor:
    """rows: [M, row bytes] uint8, whole rows of a Q4_0, Q4_1, Q8_0, Q4_K or Q6_K tensor as
    stored. Returns [M, weights a row] float32. Raises ValueError for another type."""
    if ggml_type not in BLOCK_BYTES:
        raise ValueError(f"no row de-quantization for GGUF type {ggml_type} (takes {sorted(BLOCK_BYTES)})")
    m = rows.shape[0]
    b = rows.reshape(m, -1, BLOCK_BYTES[ggml_type])  # [M, blocks, block bytes]
    if ggml_type in (12, 14):
        return _k_quant(ggml_type, b).reshape(m, -1)
    d = _f16(b[..., 0:2])  # [M, blocks, 1]
    if ggml_type == 8:
        w = d * b[..., 2:].contiguous().view(torch.int8).float()
    else:
        start = 2 if ggml_type == 2 else 4
        nib = b[..., start:]  # [M, blocks, 16]: weight i in the low nibble, i + 16 in the high
        q = torch.cat([nib & 0x0F, nib >> 4], dim=-1).float()  # [M, blocks, 32]
        w = d * (q - 8) if ggml_type == 2 else d * q + _f16(b[..., 2:4])
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
