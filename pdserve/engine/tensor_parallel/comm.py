"""ShmComm: the collectives of one replica's tensor-parallel ranks, over one shared-memory
file that every rank maps (cpu/tp_comm.c has the layout and the arithmetic).

Shared memory rather than torch.distributed's gloo: the ranks of a CPU replica share one
node, and decoder.c calls the all-reduce from C between its kernels, twice per layer.

Every collective has a number; all ranks call the same collectives in the same order, so
their numbers agree. The sum runs in rank order on every rank, so all ranks hold the same
bits and a row's bits do not depend on the other rows of the step (batch invariance).
"""

from __future__ import annotations

import ctypes
import os

import torch

from pdserve.engine import cpu
from pdserve.engine.kv_cache import map_shared_file

HEADER_BYTES = 64  # one cache line of arrival count per rank
TIMEOUT_S = 120.0  # longest a rank waits at a collective for a peer that hangs (one that dies aborts the wait at once;
#                   a prefill layer of 2,048 tokens takes < 1 s)


class TPContext(ctypes.Structure):
    """tp_comm.c's ``tp_ctx``: what decoder.c's all-reduce hook reads."""

    _fields_ = [("base", ctypes.c_void_p), ("rank", ctypes.c_int64), ("world", ctypes.c_int64), ("cap", ctypes.c_int64),
                ("bf", ctypes.c_int64), ("g", ctypes.c_uint64), ("timeout_s", ctypes.c_double), ("spent_s", ctypes.c_double)]


def segment_bytes(world: int, cap: int) -> int:
    """Bytes of the shared file for ``world`` ranks with slots of ``cap`` bytes."""
    return HEADER_BYTES * world + 2 * (world + 1) * cap


class ShmComm:
    def __init__(self, path: str, rank: int, world: int, cap: int, dtype: torch.dtype, create: bool = False,
                 timeout_s: float = TIMEOUT_S):
        """Map the segment ``path`` (made, zeroed, by rank 0 with ``create``). cap: the
        largest collective in bytes (a step's [N, H] activations in ``dtype``, or its
        [S, vocab / world] float32 logits). Raises OSError, or RuntimeError where the
        kernel library does not build."""
        self.lib = cpu.load("tp_comm")
        if self.lib is None:
            raise RuntimeError(f"tensor parallel needs the tp_comm kernels: {cpu.problem('tp_comm')}")
        if not 1 < world <= 64:
            raise ValueError(f"tensor_parallel_size {world}: 2 to 64 ranks")
        self.path, self.rank, self.world, self.cap = path, rank, world, cap
        self._buf = map_shared_file(path, segment_bytes(world, cap), create)
        self._bytes = torch.frombuffer(self._buf, dtype=torch.uint8)  # keeps the mapping alive
        self.ctx = TPContext(self._bytes.data_ptr(), rank, world, cap, int(dtype == torch.bfloat16), 0, timeout_s, 0.0)
        self.dtype = dtype

    @property
    def spent_s(self) -> float:
        """Seconds this rank has spent in all-reduces, waiting for slower ranks included."""
        return self.ctx.spent_s

    @property
    def hook(self) -> tuple[int, int]:
        """(function, context) addresses for decoder.c's all-reduce."""
        return ctypes.cast(self.lib.tp_ctx_allreduce, ctypes.c_void_p).value, ctypes.addressof(self.ctx)

    def _check(self, rc: int, what: str) -> None:
        if rc == -2:
            raise RuntimeError(f"tensor parallel rank {self.rank}: {what} aborted (a peer rank died)")
        if rc != 0:
            raise TimeoutError(f"tensor parallel rank {self.rank}: {what} timed out after {self.ctx.timeout_s:.0f} s "
                               f"(a peer rank hung)")

    def abort(self) -> None:
        """End every wait of every rank on this segment, now and later (a collective then
        raises RuntimeError): rank 0 calls it when a peer dies, a rank when rank 0 is gone."""
        self.lib.tp_abort(self.ctx.base)

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        """x: contiguous, in the group's dtype, this rank's partial sum in and the sum over all
        ranks out (the same bits on every rank). Returns x. Raises TimeoutError (a peer hung),
        RuntimeError (aborted)."""
        if x.dtype != self.dtype or not x.is_contiguous() or x.numel() * x.element_size() > self.cap:
            raise ValueError(f"all-reduce of {tuple(x.shape)} {x.dtype}: needs contiguous {self.dtype} of at most {self.cap} bytes")
        self._check(self.lib.tp_ctx_allreduce(ctypes.addressof(self.ctx), x.data_ptr(), x.numel()), "all-reduce")
        return x

    def gather_columns(self, x: torch.Tensor, widths: list[int]) -> torch.Tensor | None:
        """x: [S, widths[rank]] float32, this rank's columns. Rank 0 gets [S, sum(widths)]:
        every rank's columns in rank order; the others get None. Raises TimeoutError."""
        x = x.contiguous()
        if x.dtype != torch.float32 or x.numel() * 4 > self.cap:
            raise ValueError(f"gather of {tuple(x.shape)} {x.dtype}: needs float32 of at most {self.cap} bytes")
        self.ctx.g += 1
        g, rows = self.ctx.g, x.shape[0]
        self._slot(g, self.rank)[: x.numel() * 4].copy_(x.view(-1).view(torch.uint8))
        self._check(self.lib.tp_barrier(self.ctx.base, self.rank, self.world, g, self.ctx.timeout_s), "gather")
        if self.rank != 0:
            return None
        parts = [self._slot(g, r)[: rows * w * 4].view(torch.float32).view(rows, w) for r, w in enumerate(widths)]
        return torch.cat(parts, dim=1)

    def barrier(self) -> None:
        """Wait until every rank is here. Raises TimeoutError."""
        self.ctx.g += 1
        self._check(self.lib.tp_barrier(self.ctx.base, self.rank, self.world, self.ctx.g, self.ctx.timeout_s), "barrier")

    def _slot(self, g: int, r: int) -> torch.Tensor:
        start = HEADER_BYTES * self.world + ((g % 2) * (self.world + 1) + r) * self.cap
        return self._bytes[start : start + self.cap]

    def unlink(self) -> None:
        """Remove the file (every rank has mapped it; the mappings stay)."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
