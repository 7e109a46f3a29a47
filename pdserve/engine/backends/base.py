"""The compute backend interface: a step's metadata, built once, and the ops that run it.

As mini-sglang's ``attention/base.py``: ``prepare(batch)`` turns the scheduler's batch into
a ``StepMetadata`` (token ids, positions, KV slots, block tables) once per step, and
``forward(layer, q, k, v, meta)`` stores the layer's new K/V and attends. A backend also
owns the model's arithmetic (``linear``, ``add_rmsnorm``, ``rope_``, ``silu_mul``), so one
object decides how a step computes. Backends register by name (``backends/__init__.py``):
``cpu`` (pdserve's C kernels), ``torch`` (portable reference), ``cuda`` (a GPU).

Every CPU backend follows one numerics rule, batch invariance: a token's outputs depend on
its own sequence only, never on the other rows of the step, so a request gets the same
bits alone, in any batch, whole or chunked, decoded or recomputed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from pdserve.engine.kv_cache import PagedKVCache
from pdserve.engine.quantized import QuantizedWeight


@dataclass
class StepMetadata:
    input_ids: torch.Tensor  # [N] int64, the step's new tokens, sequence after sequence
    positions: torch.Tensor  # [N] int64, each token's position in its sequence
    slot_mapping: torch.Tensor  # [N] int64, the pool slot each new token's K/V goes to
    token_seq: torch.Tensor  # [N] int32, each token's sequence (row of block_tables)
    block_tables: torch.Tensor  # [S, max_blocks] int32, padded with block 0
    query_starts: list[int]  # [S + 1] offsets of each sequence's new tokens
    context_lens: list[int]  # [S] tokens of context (cached + new) per sequence
    last_token_index: torch.Tensor  # [S] int64, each sequence's last new token (its logits row)
    decode_only: bool  # one new token per sequence
    # layer-wise streaming: (LayerProgress, tokens written once this step's layer is stored)
    kv_progress: list[tuple[object, int]] | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # a backend's own (e.g. the cuda decode masks)
    rope_lens: list[int] | None = None  # [S] max(prompt, all tokens so far) per sequence: longrope picks its table by it

    @property
    def num_tokens(self) -> int:
        return self.query_starts[-1]


class Backend(ABC):
    """One engine's compute: ``kv_cache`` is its pool, ``num_threads`` the threads a kernel may use."""

    name = "base"
    # tensor parallel: (function, context) addresses of the all-reduce a fused decoder calls
    # after each row-parallel projection (tensor_parallel/comm.py); None on one rank
    allreduce_hook: tuple[int, int] | None = None

    def __init__(self, kv_cache: PagedKVCache, num_threads: int = 1):
        self.kv_cache = kv_cache
        self.device = kv_cache.device
        self.num_threads = num_threads

    def step_scope(self) -> AbstractContextManager:
        """The context a whole step (forward and sampling) runs in (default: none)."""
        return nullcontext()

    # -- step metadata -------------------------------------------------------------------------
    def prepare(self, batch: list[tuple[Any, int]]) -> StepMetadata:
        """batch: (Sequence, new tokens) pairs. Tokens num_computed .. num_computed + n of each."""
        ids, positions, tables, token_seq, query_starts, context_lens = [], [], [], [], [0], []
        bs = self.kv_cache.block_size
        for i, (seq, num_new) in enumerate(batch):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
            ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            token_seq.extend([i] * num_new)
            tables.append(seq.block_table[: -(-end // bs)])
            query_starts.append(query_starts[-1] + num_new)
            context_lens.append(end)
        max_blocks = max(len(t) for t in tables)
        dev = self.device
        pos = torch.tensor(positions, dtype=torch.long)
        table_t = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32)
        seq_t = torch.tensor(token_seq, dtype=torch.int32)
        slots = table_t[seq_t.long(), pos // bs].long() * bs + pos % bs
        meta = StepMetadata(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev), positions=pos.to(dev), slot_mapping=slots.to(dev),
            token_seq=seq_t.to(dev), block_tables=table_t.to(dev), query_starts=query_starts, context_lens=context_lens,
            last_token_index=torch.tensor(query_starts[1:], device=dev) - 1, decode_only=all(n == 1 for _, n in batch),
            kv_progress=[(seq.kv_progress, min(seq.num_computed_tokens + n, seq.num_prompt_tokens))
                         for seq, n in batch if seq.kv_progress is not None] or None,
            rope_lens=[max(seq.num_prompt_tokens, len(seq.token_ids)) for seq, _ in batch])
        self.prepare_extra(meta)
        return meta

    def prepare_extra(self, meta: StepMetadata) -> None:
        """A backend's own per-step metadata, into ``meta.extra`` (default: none)."""

    def context_slots(self, meta: StepMetadata, i: int, start: int, end: int) -> torch.Tensor:
        """[end - start] int64: the pool slots of sequence ``i``'s positions start .. end - 1."""
        bs = self.kv_cache.block_size
        positions = torch.arange(start, end, device=meta.block_tables.device)
        return meta.block_tables[i, positions // bs].long() * bs + positions % bs

    def store_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor, meta: StepMetadata) -> None:
        """k, v: [N, kv_heads, D] of the step's new tokens, into their slots of layer ``layer``."""
        self.kv_cache.k[layer].index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
        self.kv_cache.v[layer].index_copy_(1, meta.slot_mapping, v.transpose(0, 1))
        self.mark_stored(layer, meta)

    def mark_stored(self, layer: int, meta: StepMetadata) -> None:
        """Tell layer-wise readers that layer ``layer`` of the step's KV is in the pool."""
        if meta.kv_progress:  # this layer's KV may go out now (kv_transfer/progress.py)
            for progress, num_tokens in meta.kv_progress:
                progress.mark(layer, num_tokens)

    @abstractmethod
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: StepMetadata, scale: float) -> torch.Tensor:
        """Store k, v ([N, kv_heads, D]) and attend: q [N, heads, D] -> [N, heads * D].
        Token t sees its sequence's positions 0 .. meta.positions[t]."""

    windowed_kernels = False  # whether forward_windowed runs in this backend's kernels (else: torch rows, a Python loop)

    def forward_windowed(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: StepMetadata, scale: float,
                         window: int | None, softcap: float | None) -> torch.Tensor:
        """``forward`` with a sliding window (token t sees its positions
        max(0, p - window + 1) .. p, HF's ``kv_idx > q_idx - sliding_window``) and
        attention-logit soft-capping (``tanh(s / cap) * cap`` on the scaled scores, Gemma 2).
        This default is for backends whose kernels have neither: torch ops, one query row at a
        time (batch invariant, as the torch backend), in HF's eager order: scores in the model
        dtype, softmax in float32 cast back, then @ V. q [N, heads, D], k, v [N, kv_heads, D]
        -> [N, heads * D]. Every backend's KV pool has this layout, so each can run it."""
        self.store_kv(layer, k, v, meta)
        k_cache, v_cache = self.kv_cache.k[layer], self.kv_cache.v[layer]  # [kv_heads, slots, D]
        heads, kv_heads = q.shape[1], k_cache.shape[0]
        out = torch.empty(q.shape[0], heads, q.shape[2], dtype=q.dtype, device=q.device)
        for i, end in enumerate(meta.context_lens):
            first, stop = meta.query_starts[i], meta.query_starts[i + 1]
            base = max(0, end - (stop - first) - window + 1) if window is not None else 0  # the first token's first key
            slots = self.context_slots(meta, i, base, end)  # [end - base]
            keys = k_cache[:, slots].repeat_interleave(heads // kv_heads, dim=0)  # [heads, end - base, D]
            values = v_cache[:, slots].repeat_interleave(heads // kv_heads, dim=0)
            for t in range(first, stop):
                p = end - (stop - t)  # this token's position
                lo = max(0, p - window + 1) if window is not None else 0
                scores = torch.matmul(q[t][:, None], keys[:, lo - base : p + 1 - base].transpose(1, 2)) * scale  # [heads, 1, keys]
                if softcap is not None:
                    scores = torch.tanh(scores / softcap) * softcap
                probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
                out[t] = torch.matmul(probs, values[:, lo - base : p + 1 - base])[:, 0]  # [heads, D]
        return out.view(q.shape[0], -1)

    def forward_latent(self, layer: int, q_lat: torch.Tensor, q_pe: torch.Tensor, c: torch.Tensor, k_pe: torch.Tensor, meta: StepMetadata,
                       scale: float) -> torch.Tensor:
        """Multi-head latent attention (DeepSeek-V2, arXiv:2405.04434 sec. 2.1) in its absorbed
        form, over the latent cache. Stores each new token's latent ``[c, k_pe]`` (R + r
        elements) in halves, the first in layer ``layer``'s k pool and the rest in its v pool
        (one KV head of ``KVSpec.head_dim``; a pad element where R + r is odd), then per token t
        at position p and head h:
            s_j = scale * (q_lat[t, h] . c_j + q_pe[t, h] . k_pe_j)    j = 0 .. p
            out[t, h] = sum_j softmax(s)_j c_j
        q_lat [N, heads, R] (the queries' no-rope part through each head's key up-projection),
        q_pe [N, heads, r], c [N, R], k_pe [N, r] -> [N, heads, R]. Torch ops one query row at
        a time (batch invariant), scores in the model dtype and the softmax in float32 cast
        back, as HF's eager attention."""
        half, R, r = self.kv_cache.spec.head_dim, c.shape[1], k_pe.shape[1]
        latent = torch.cat([c, k_pe, c.new_zeros(c.shape[0], 2 * half - R - r)], dim=1)  # [N, 2 half]
        self.store_kv(layer, latent[:, None, :half], latent[:, None, half:], meta)
        k_cache, v_cache = self.kv_cache.k[layer][0], self.kv_cache.v[layer][0]  # [slots, half]
        out = torch.empty_like(q_lat)
        for i, end in enumerate(meta.context_lens):
            first, stop = meta.query_starts[i], meta.query_starts[i + 1]
            slots = self.context_slots(meta, i, 0, end)  # [end]
            context = torch.cat([k_cache[slots], v_cache[slots]], dim=1)  # [end, 2 half]
            cs, kp = context[:, :R], context[:, R : R + r]
            for t in range(first, stop):
                n = end - (stop - t) + 1  # keys this token sees
                scores = (torch.matmul(q_lat[t], cs[:n].T) + torch.matmul(q_pe[t], kp[:n].T)) * scale  # [heads, n]
                probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q_lat.dtype)
                out[t] = torch.matmul(probs, cs[:n])  # [heads, R]
        return out

    def fuse_layers(self, layers: list[Any]) -> Any | None:
        """The model's decoder layers (models/llama.py ``DecoderLayer``) as one callable,
        ``(h [N, H], meta) -> (h, residual)``, that computes what calling them one by one
        does, to the bit; or None (the default) where this backend has none."""
        return None

    # -- arithmetic ----------------------------------------------------------------------------
    pack_copies = False  # whether ``pack`` returns a copy (the caller may reuse the weight's memory after)

    @abstractmethod
    def pack(self, weight: torch.Tensor) -> Any:
        """A linear layer's weight [N, K] in this backend's form (done once at load)."""

    @abstractmethod
    def linear(self, x: torch.Tensor, packed: Any, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
        """x: [M, K] -> [M, out_features]."""

    @contextmanager
    def loading(self, capacity: int):
        """Scope in which a model packs its weights; ``capacity``: bytes at most that its
        ``pack`` and ``pack_quantized`` results take. A backend may place them in one run of
        memory in the order packed (default: nothing to do)."""
        yield

    def arrange(self, packed: list[Any]) -> list[Any]:
        """The model's packed weights (``pack`` and ``pack_quantized`` results) in the order a
        step reads them; returns them where this backend reads them fastest, same order
        (default: as they are)."""
        return packed

    def pack_quantized(self, weight: QuantizedWeight) -> Any | None:
        """A quantized weight in this backend's form, or None (the default) where the backend
        does not compute with its blocks as they are: the caller keeps the dense weight."""
        return None

    def discard(self, packed: Any) -> None:
        """A ``pack_quantized`` result the caller does not keep, returned as soon as it is made
        (default: nothing to do; the garbage collector frees it)."""

    def dequantize(self, packed: Any, out_features: int, in_features: int) -> torch.Tensor:
        """The float32 weight [out_features, in_features] a ``pack_quantized`` result computes with."""
        raise NotImplementedError

    def linear_quantized(self, x: torch.Tensor, packed: Any, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
        """``linear`` over a ``pack_quantized`` result: the same bits as over its de-quantized weight."""
        raise NotImplementedError

    @abstractmethod
    def add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """residual = residual + x (x itself when residual is None); returns
        (RMSNorm(residual) * weight, residual), both [M, H]."""

    @abstractmethod
    def rope_(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotary embedding of x [T, heads, D] at positions [T], with tables cos, sin
        [max_position, D] float32; in place where the backend can, returns the result."""

    @abstractmethod
    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up: [M, 2I] -> silu(gate) * up: [M, I]."""
