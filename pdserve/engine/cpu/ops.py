"""Python face of the C kernels (linear.c, pointwise.c, attention.c) over torch tensors.

Each function takes and returns CPU tensors of one dtype, float32 or bfloat16, with the
shapes in its docstring. Calls go through ctypes (about 1-3 us each). ``available()`` says
which kernels built and passed their start-up self-check (``self_check``); a kernel that fails
it is disabled with a warning and its caller takes the torch path.
"""

from __future__ import annotations

import ctypes
import logging

import torch

from pdserve.engine import cpu

logger = logging.getLogger(__name__)

KERNELS = ("linear", "pointwise", "attention")
_problems: dict[str, str | None] = {}  # kernel -> why it is unavailable (None: available)


def _lib(name: str):
    return cpu.load(name)


def _bf(t: torch.Tensor) -> int:
    if t.dtype == torch.bfloat16:
        return 1
    if t.dtype == torch.float32:
        return 0
    raise ValueError(f"pdserve's CPU kernels take float32 or bfloat16, not {t.dtype}")


def isa(dtype: torch.dtype = torch.bfloat16) -> str | None:
    """The path the kernels take for ``dtype``: "amx_bf16" (bf16 on AMX tiles), or the vector
    ISA they were built for ("avx512_bf16", "avx512f", "avx2", "portable"); None where they
    did not build."""
    lib = _lib("linear")
    return lib.linear_isa(int(dtype == torch.bfloat16)).decode() if lib is not None else None


def _empty(alloc, numel: int, dtype: torch.dtype) -> torch.Tensor:
    out = alloc(numel, dtype) if alloc is not None else None
    return out if out is not None else torch.empty(numel, dtype=dtype)


def pack(weight: torch.Tensor, alloc=None) -> torch.Tensor:
    """weight: [N, K] float32 or bf16 (an nn.Linear's). Returns it packed for ``linear``
    (linear.c's panels; a flat tensor of the same dtype), in ``alloc(numel, dtype)``'s
    memory where that gives some (huge_pages.Arena.take), else in torch's."""
    N, K = weight.shape
    lib = _lib("linear")
    w = weight.detach().contiguous()
    out = _empty(alloc, lib.linear_packed_numel(N, K, _bf(w)), w.dtype)
    (lib.linear_pack_bf16 if _bf(w) else lib.linear_pack_f32)(w.data_ptr(), N, K, K, out.data_ptr())
    return out


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None = None, num_threads: int = 1) -> torch.Tensor:
    """x: [M, K] (rows may be strided, elements contiguous); packed: ``pack(weight)`` of a
    [out_features, K] weight; bias: [out_features] or None. Returns [M, out_features] in x's
    dtype. Each output is summed in an order that depends on K only (linear.c), so a row's
    result is the same bits in any batch."""
    M, K = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty((M, out_features), dtype=x.dtype)
    fn = _lib("linear").linear_bf16 if _bf(x) else _lib("linear").linear_f32
    fn(x.data_ptr(), M, K, x.stride(0), packed.data_ptr(), out_features, bias.data_ptr() if bias is not None else None,
       out.data_ptr(), out_features, num_threads)
    return out


def linear_silu(x: torch.Tensor, packed: torch.Tensor, intermediate: int, bias: torch.Tensor | None = None,
                num_threads: int = 1) -> torch.Tensor | None:
    """A SwiGLU MLP's gate-up projection with its activation applied as it stores: x: [M, K]
    bf16 (rows may be strided, elements contiguous); packed: ``pack(weight)`` of the [2I, K]
    gate-up weight (gate rows, then up rows); bias: [2I] or None. Returns silu(gate) * up:
    [M, I], the same bits as ``silu_mul(linear(x, packed, 2I, bias))`` (linear.c's
    ``linear_silu_bf16``); None where the kernel does not take it (not bf16 on AMX tiles, or I
    not a multiple of 32)."""
    if x.dtype != torch.bfloat16:
        return None
    M, K = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty((M, intermediate), dtype=x.dtype)
    rc = _lib("linear").linear_silu_bf16(x.data_ptr(), M, K, x.stride(0), packed.data_ptr(), intermediate,
                                         bias.data_ptr() if bias is not None else None, out.data_ptr(), intermediate, num_threads)
    return out if rc == 0 else None


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, add: bool, weight: torch.Tensor, eps: float, num_threads: int = 1) -> torch.Tensor:
    """x, residual: [M, H] (residual contiguous, updated in place: residual + x, or x when
    ``add`` is False); weight: [H]. Returns RMSNorm(residual) * weight: [M, H]. Rows split
    among ``num_threads`` (each row's bits are the same)."""
    M, H = x.shape
    out = torch.empty((M, H), dtype=x.dtype)
    _lib("pointwise").add_rmsnorm(x.data_ptr(), x.stride(0), residual.data_ptr(), residual.stride(0), int(add), weight.data_ptr(),
                                  out.data_ptr(), H, M, H, eps, _bf(x), num_threads)
    return out


def rope_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_threads: int = 1) -> None:
    """Rotary embedding in place. x: [T, heads, D] (head dim contiguous, other strides free);
    positions: [T] int64; cos, sin: [max_position, D] float32. Tokens split among ``num_threads``."""
    T, heads, D = x.shape
    _lib("pointwise").rope_inplace(x.data_ptr(), T, heads, D, x.stride(0), x.stride(1), positions.data_ptr(), cos.data_ptr(),
                                   sin.data_ptr(), _bf(x), num_threads)


def silu_mul(gate_up: torch.Tensor, num_threads: int = 1) -> torch.Tensor:
    """gate_up: [M, 2I] (gate then up). Returns silu(gate) * up: [M, I]. Rows split among ``num_threads``."""
    M, two_i = gate_up.shape
    out = torch.empty((M, two_i // 2), dtype=gate_up.dtype)
    _lib("pointwise").silu_mul(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), two_i // 2, M, two_i // 2, _bf(gate_up), num_threads)
    return out


def mask_logits_(row: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """row: [vocab] contiguous logits; mask: [ceil(vocab / 32)] int32 (pdserve/structured.py
    fill_masks). Sets row[t] = -inf where token t's bit is clear, in place; returns row."""
    if mask.numel() * 32 < row.numel():
        raise ValueError(f"a mask of {mask.numel()} words covers fewer than the row's {row.numel()} tokens")
    _lib("pointwise").mask_logits(row.data_ptr(), row.numel(), mask.contiguous().data_ptr(), _bf(row))
    return row


QUANT_TYPES = {2: "Q4_0", 3: "Q4_1", 8: "Q8_0", 12: "Q4_K", 14: "Q6_K"}  # ggml_type -> name: the GGUF block types ``qpack`` takes


def qpack_ok(ggml_type: int, out_features: int, in_features: int) -> bool:
    """Whether ``qpack`` takes this type and shape (linear_q.h decides: a type of QUANT_TYPES,
    in_features a multiple of its GGUF block, 32 weights or 256 for the K-quants)."""
    return _lib("linear").qlinear_packed_bytes(ggml_type, out_features, in_features) >= 0


def quantized_ok(dtype: torch.dtype) -> bool:
    """Whether ``qlinear`` gives the dense ``linear``'s bits in ``dtype`` here: the linear
    kernel built, and bf16 is not on AMX tiles (whose dense path packs for the tiles)."""
    return available("linear") and not (dtype == torch.bfloat16 and isa(dtype) == "amx_bf16")


def qpack(ggml_type: int, data: torch.Tensor, out_features: int, in_features: int, alloc=None) -> torch.Tensor:
    """data: [out_features, row bytes] uint8, a GGUF tensor's blocks as stored (each row
    in_features / 32 blocks, or / 256 for the K-quants). Returns the packed form for ``qlinear`` (uint8, linear_q.h),
    in ``alloc``'s memory where it gives some (as ``pack``).
    Raises ValueError for a type or shape it does not take (``qpack_ok``)."""
    lib = _lib("linear")
    size = lib.qlinear_packed_bytes(ggml_type, out_features, in_features)
    if size < 0:
        raise ValueError(f"qlinear takes GGUF types {sorted(QUANT_TYPES.values())} with in_features % 32 == 0 (% 256 for Q4_K "
                         f"and Q6_K), not type {QUANT_TYPES.get(ggml_type, ggml_type)} [{out_features}, {in_features}]")
    data = data.contiguous()
    out = _empty(alloc, size, torch.uint8)
    lib.qlinear_pack(ggml_type, data.data_ptr(), out_features, in_features, out.data_ptr())
    return out


def qdequant(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The float32 weights [out_features, in_features] of a ``qpack`` result (gguf-py's rule)."""
    out = torch.empty((out_features, in_features), dtype=torch.float32)
    _lib("linear").qlinear_dequant(packed.data_ptr(), out.data_ptr())
    return out


def qlinear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None = None, num_threads: int = 1) -> torch.Tensor:
    """``linear`` over a ``qpack`` result: x [M, K] float32 or bf16 -> [M, out_features], the
    same bits as ``linear`` over the de-quantized weight in x's dtype (bf16: rounded to
    nearest even), where ``quantized_ok``."""
    M, K = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty((M, out_features), dtype=x.dtype)
    fn = _lib("linear").qlinear_bf16 if _bf(x) else _lib("linear").qlinear_f32
    fn(x.data_ptr(), M, K, x.stride(0), packed.data_ptr(), out_features, bias.data_ptr() if bias is not None else None,
       y.data_ptr(), out_features, num_threads)
    return y


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor, token_seq: torch.Tensor,
                    positions: torch.Tensor, block_size: int, scale: float, num_threads: int = 1, k_new: torch.Tensor | None = None,
                    v_new: torch.Tensor | None = None, slots: torch.Tensor | None = None, window: int | None = None,
                    softcap: float | None = None) -> torch.Tensor:
    """q: [T, heads, D] (token stride free, heads contiguous); k_cache, v_cache:
    [kv_heads, slots, D] contiguous (one layer of the pool); k_new, v_new: [T, kv_heads, D]
    (heads contiguous, token stride free, the same for both) and slots: [T] int64, the step's
    new keys and values and where they go (stored first); or None when already stored.
    block_tables: [S, max_blocks] int32; token_seq: [T] int32, each token's row of
    block_tables; positions: [T] int64. Token t attends to its sequence's positions
    0..positions[t], or with a ``window`` (tokens) its last ones, max(0, p - window + 1)..p
    (HF's ``kv_idx > q_idx - sliding_window``); ``softcap``: each scaled score s becomes
    ``softcap * tanh(s / softcap)`` (Gemma 2). Returns [T, heads * D]. Raises ValueError for a
    head layout the kernel does not take (more than 32 query heads per KV head, or D > 256)."""
    T, heads, D = q.shape
    if q.stride(2) != 1 or q.stride(1) != D:
        q = q.contiguous()
    ldkv = 0
    if k_new is not None:
        if k_new.stride() != v_new.stride() or k_new.stride(2) != 1 or k_new.stride(1) != D:
            k_new, v_new = k_new.contiguous(), v_new.contiguous()
        ldkv = k_new.stride(0)
    out = torch.empty((T, heads * D), dtype=q.dtype)
    rc = _lib("attention").paged_attention_windowed(
        q.data_ptr(), T, q.stride(0), heads, k_cache.shape[0], D, k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0),
        k_new.data_ptr() if k_new is not None else None, v_new.data_ptr() if k_new is not None else None, ldkv,
        slots.data_ptr() if k_new is not None else None,
        block_tables.data_ptr(), block_tables.shape[1], token_seq.data_ptr(), positions.data_ptr(), block_size, scale,
        out.data_ptr(), _bf(q), num_threads, window or 0, softcap or 0.0)
    if rc != 0:
        raise ValueError(f"paged attention kernel: unsupported heads {heads}/{k_cache.shape[0]} or head_dim {D}")
    return out


class _DecoderModel(ctypes.Structure):
    """decoder.c's ``decoder_model``."""

    _fields_ = [(n, ctypes.c_int64) for n in ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "kv_head_stride",
                                              "block_size", "bf", "nthreads")] + [
        ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("weights", ctypes.POINTER(ctypes.c_void_p)),
        ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p)] + [
        (n, ctypes.c_void_p) for n in ("linear", "add_rmsnorm", "rope", "silu_mul", "attention", "allreduce", "allreduce_ctx", "linear_silu")]


class Decoder:
    """A model's decoder layers as one C call per step (decoder.c): the same kernels in the
    same order as calling ``linear``, ``add_rmsnorm``, ``rope_``, ``paged_attention`` and
    ``silu_mul`` layer by layer, so the same bits, without the Python between them (on AMX
    the gate-up projection applies ``silu_mul`` as it stores: linear.c's ``linear_silu_bf16``,
    the same bits again).

    layers: per layer a dict of the tensors decoder.c's ``weights`` lists (``w_qkv``,
    ``b_qkv``, ``w_o``, ``b_o``, ``w_gu``, ``b_gu``, ``w_down``, ``b_down``: packed weights
    and biases or None; ``norm_in``, ``norm_post``: [H]; ``k``, ``v``: the layer's pool
    [kv_heads, slots, D]); the sizes as named; quantized: the four weights are ``qpack``
    results (all or none); allreduce: under tensor parallelism, (function, context) addresses
    that sum the o and down projections' [N, H] outputs over the ranks in place
    (tensor_parallel/comm.py). The tensors must outlive the Decoder."""

    _ORDER = ("w_qkv", "b_qkv", "w_o", "b_o", "w_gu", "b_gu", "w_down", "b_down", "norm_in", "norm_post", "k", "v")

    def __init__(self, layers: list[dict], *, hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int, block_size: int,
                 eps: float, scale: float, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype, num_threads: int, quantized: bool = False,
                 allreduce: tuple[int, int] | None = None):
        self._keep = (layers, cos, sin)
        ptrs = [t.data_ptr() if t is not None else None for layer in layers for t in (layer[n] for n in self._ORDER)]
        self._weights = (ctypes.c_void_p * len(ptrs))(*ptrs)
        fn = lambda name, f: ctypes.cast(getattr(_lib(name), f), ctypes.c_void_p).value  # noqa: E731
        self._model = _DecoderModel(
            len(layers), hidden, heads, kv_heads, head_dim, intermediate, layers[0]["k"].stride(0), block_size, _bf(layers[0]["norm_in"]),
            num_threads, eps, scale, ctypes.cast(self._weights, ctypes.POINTER(ctypes.c_void_p)), cos.data_ptr(), sin.data_ptr(),
            fn("linear", ("qlinear_" if quantized else "linear_") + ("bf16" if dtype == torch.bfloat16 else "f32")), fn("pointwise", "add_rmsnorm"),
            fn("pointwise", "rope_inplace"), fn("pointwise", "silu_mul"), fn("attention", "paged_attention"), *(allreduce or (None, None)),
            # the gate-up projection with silu_mul applied as it stores (AMX; it declines where it does not apply)
            None if quantized or dtype != torch.bfloat16 else fn("linear", "linear_silu_bf16"))

    def __call__(self, h: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, token_seq: torch.Tensor,
                 block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h: [N, H] contiguous, the embeddings (overwritten); positions, slots: [N] int64;
        token_seq: [N] int32; block_tables: [S, max_blocks] int32. Stores each layer's K/V in
        its slots. Returns (the last layer's output, the residual), both [N, H]. Raises
        ValueError for a head layout the attention kernel does not take, MemoryError when
        its scratch cannot be allocated."""
        residual = torch.empty_like(h)
        rc = _lib("decoder").decoder_layers(ctypes.byref(self._model), h.data_ptr(), residual.data_ptr(), h.shape[0], positions.data_ptr(),
                                            slots.data_ptr(), token_seq.data_ptr(), block_tables.data_ptr(), block_tables.shape[1])
        if rc == -1:
            raise ValueError("paged attention kernel: unsupported head layout")
        if rc == -3:
            raise TimeoutError("tensor parallel: an all-reduce failed (a peer rank died or hung)")
        if rc != 0:
            raise MemoryError("decoder layers: no memory for the step's activations")
        return h, residual


def _check_one(name: str, dtype: torch.dtype) -> None:
    """Raise AssertionError if kernel ``name`` disagrees with plain torch on random data."""
    g = torch.Generator().manual_seed(0)
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    rnd = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    if name == "linear":
        x, w, b = rnd(5, 70), rnd(9, 70), rnd(9)
        torch.testing.assert_close(linear(x, pack(w), 9, b).float(), (x.float() @ w.float().T + b.float()), **tol)
    elif name == "pointwise":
        x, r, w = rnd(3, 40), rnd(3, 40), rnd(40)
        ref_r = (r.float() + x.float()).to(dtype)
        ref = w.float() * (ref_r.float() * torch.rsqrt(ref_r.float().pow(2).mean(-1, keepdim=True) + 1e-5))
        out = add_rmsnorm(x, r, True, w, 1e-5)
        torch.testing.assert_close(r, ref_r, **tol)
        torch.testing.assert_close(out.float(), ref, **tol)
        gu = rnd(3, 16)
        torch.testing.assert_close(silu_mul(gu).float(), torch.nn.functional.silu(gu[:, :8].float()) * gu[:, 8:].float(), **tol)
        q, pos = rnd(2, 2, 8), torch.tensor([0, 5])
        cos, sin = torch.rand(6, 8, generator=g), torch.rand(6, 8, generator=g)
        rot = torch.cat([-q[..., 4:], q[..., :4]], -1).float()
        ref = q.float() * cos[pos][:, None] + rot * sin[pos][:, None]
        rope_(q, pos, cos, sin)
        torch.testing.assert_close(q.float(), ref, **tol)
    elif name == "attention":
        heads, kv_heads, bs, n = 4, 2, 4, 11
        for D in (16, 32):  # 32: the AMX path where it runs (D % 32 == 0)
            k, v, q = rnd(kv_heads, 4 * bs, D), rnd(kv_heads, 4 * bs, D), rnd(n, heads, D)
            table = torch.tensor([[3, 1, 0, 2]], dtype=torch.int32)
            slots = (table[0].long()[:, None] * bs + torch.arange(bs)).view(-1)[:n]
            out = paged_attention(q, k, v, table, torch.zeros(n, dtype=torch.int32), torch.arange(n), bs, D ** -0.5)
            kk = k[:, slots].float().repeat_interleave(2, 0)
            vv = v[:, slots].float().repeat_interleave(2, 0)
            ref = torch.nn.functional.scaled_dot_product_attention(q.float().transpose(0, 1), kk, vv, is_causal=True)
            torch.testing.assert_close(out.float().view(n, heads, D), ref.transpose(0, 1), **tol)


def available(name: str) -> bool:
    """Whether kernel ``name`` (one of KERNELS) built here and passed its self-check in both
    dtypes (checked once per process; a failure is logged and disables it)."""
    return problem(name) is None


def problem(name: str) -> str | None:
    """Why kernel ``name`` (one of KERNELS) is unavailable: its build's problem
    (``cpu.problem``, with the compiler's message) or its self-check's failure; None if it
    is available."""
    if name not in _problems:
        why = cpu.problem(name) if _lib(name) is None else None
        if why is None:
            try:
                for dtype in (torch.float32, torch.bfloat16):
                    _check_one(name, dtype)
            except (AssertionError, ValueError, OSError) as e:
                logger.warning("pdserve: the %s kernel failed its self-check against torch (%s); using torch for it", name, e)
                why = f"the {name} kernel failed its self-check against torch: {e}"
        _problems[name] = why
    return _problems[name]
