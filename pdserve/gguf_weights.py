"""A GGUF's quantized tensors, named and ordered as the HF model's parameters, for decode
pools that read the blocks in place (engine/quantized.py, cluster.yaml ``weights``).

transformers de-quantizes the same file into the model both pools load (model_loader.py);
this reads the blocks as they are, maps llama.cpp's tensor names to HF's and applies the
row permutation transformers applies to a Llama GGUF's Q and K projections (its
``LlamaTensorProcessor``: llama.cpp stores their rotary halves interleaved). The engine
checks each layer's de-quantized blocks against the loaded weight bit for bit, so a wrong
mapping costs speed, never results.
"""

from __future__ import annotations

import logging
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pdserve.engine.quantized import QuantizedWeight

log = logging.getLogger(__name__)

_LAYER = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_TOP = {"token_embd": "model.embed_tokens", "output": "lm_head"}
_DENSE = {"F32", "F16", "BF16", "F64"}  # stored unquantized: the model's own weights serve


def hf_name(gguf_name: str) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; None for a tensor
    that is no linear layer's weight."""
    parts = gguf_name.split(".")
    if parts[-1] != "weight":
        return None
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _LAYER:
        return f"model.layers.{parts[1]}.{_LAYER[parts[2]]}.weight"
    if len(parts) == 2 and parts[0] in _TOP:
        return f"{_TOP[parts[0]]}.weight"
    return None


def _unpermute_rows(data: np.ndarray, n_head: int) -> np.ndarray:
    """transformers' ``_reverse_permute_weights`` on rows: [N, ...] as [n_head, N / n_head / 2, 2, ...]
    with the last two row axes swapped."""
    n = data.shape[0]
    return data.reshape(n_head, n // n_head // 2, 2, *data.shape[1:]).swapaxes(1, 2).reshape(data.shape)


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF as its header describes it: ``dims`` as stored (``ne0``, the
    contiguous one, first), ``ggml_type`` (ggml's numbering) and ``offset``, its bytes' place
    in the file."""

    name: str
    dims: tuple[int, ...]
    ggml_type: int
    offset: int


# struct formats of the scalar metadata types (gguf's GGUFValueType numbering); 8 = string, 9 = array
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def read_header(buf: memoryview) -> tuple[dict[str, object], list[TensorInfo]]:
    """The header of a GGUF (version 2 or 3) in ``buf``: its scalar and string metadata by key
    (arrays are skipped, so the tokenizer's vocabulary is never decoded), and its tensors.

    Why not ``gguf.GGUFReader``: it builds a numpy view of every metadata item, which for the
    bundled model's 49,152-token vocabulary took 5.5 s of a decode replica's start (AMD EPYC
    Zen 4, 2026-12-03); this walks the same layout (ggml's docs/gguf.md) in ~0.1 s. Tests
    compare the two on the bundled file (tests/unit/test_quantized.py). Raises ValueError
    for a file that is no little-endian GGUF of version 2 or 3, or is cut short."""
    try:
        return _read_header(buf)
    except struct.error as e:
        raise ValueError(f"GGUF header cut short: {e}") from None


def _read_header(buf: memoryview) -> tuple[dict[str, object], list[TensorInfo]]:
    magic, version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", buf, 0)
    if magic != b"GGUF" or version not in (2, 3):
        raise ValueError(f"not a GGUF of version 2 or 3 (magic {bytes(magic)!r}, version {version})")
    pos = 24

    def string() -> str:
        nonlocal pos
        (n,) = struct.unpack_from("<Q", buf, pos)
        pos += 8 + n
        return bytes(buf[pos - n : pos]).decode("utf-8", errors="replace")

    def skip_array() -> None:
        nonlocal pos
        item, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if item == 8:
            for _ in range(count):
                pos += 8 + struct.unpack_from("<Q", buf, pos)[0]
        elif item == 9:
            for _ in range(count):
                skip_array()
        elif item in _SCALAR:
            pos += count * struct.calcsize(_SCALAR[item])
        else:
            raise ValueError(f"GGUF metadata: an array of unknown value type {item}")

    meta: dict[str, object] = {}
    for _ in range(n_kv):
        key = string()
        (kind,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        if kind == 8:
            meta[key] = string()
        elif kind == 9:
            skip_array()
        elif kind in _SCALAR:
            (meta[key],) = struct.unpack_from(_SCALAR[kind], buf, pos)
            pos += struct.calcsize(_SCALAR[kind])
        else:
            raise ValueError(f"GGUF metadata {key}: unknown value type {kind}")
    infos = []
    for _ in range(n_tensors):
        name = string()
        (n_dims,) = struct.unpack_from("<I", buf, pos)
        dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
        pos += 4 + 8 * n_dims
        ggml_type, offset = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        infos.append(TensorInfo(name, tuple(dims), ggml_type, offset))
    align = int(meta.get("general.alignment", 32))
    start = -(-pos // align) * align  # the data section begins at the next multiple of the alignment
    return meta, [TensorInfo(t.name, t.dims, t.ggml_type, start + t.offset) for t in infos]


def read_quantized(path: Path, config, supported: set[int]) -> dict[str, QuantizedWeight]:
    """The linear layers' weights of the GGUF at ``path`` whose block type is in ``supported``
    (ggml type numbers), by HF parameter name; ``config``: the HF model config (head counts).
    Other quantized types are left to the de-quantized model, and logged by name."""
    import mmap

    import gguf

    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        meta, tensors = read_header(memoryview(mapped))
        arch = meta.get("general.architecture", "")
        out: dict[str, QuantizedWeight] = {}
        left: Counter[str] = Counter()
        for t in tensors:
            kind = gguf.GGMLQuantizationType(t.ggml_type).name
            name = hf_name(t.name)
            if name is None or kind in _DENSE:
                continue
            if t.ggml_type not in supported:
                left[kind] += 1
                continue
            block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(t.ggml_type)]
            k, n = t.dims[0], int(np.prod(t.dims[1:]))
            row = k // block * block_bytes
            data = np.frombuffer(mapped, np.uint8, n * row, t.offset).reshape(n, row).copy()  # [N, row bytes]
            if arch == "llama" and (".attn_q." in t.name or ".attn_k." in t.name):
                heads = config.num_attention_heads if ".attn_q." in t.name else config.num_key_value_heads
                data = np.ascontiguousarray(_unpermute_rows(data, heads))
            out[name] = QuantizedWeight(t.ggml_type, torch.from_numpy(data), n, k)
    finally:
        del mapped  # closed when the last view of it goes (the copies above hold none)
    if "lm_head.weight" not in out and "model.embed_tokens.weight" in out and getattr(config, "tie_word_embeddings", False):
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    if left:
        log.info("%s: %s left de-quantized (the quantized kernels take %s)", path.name,
                 ", ".join(f"{n} tensors of {k}" for k, n in sorted(left.items())), sorted(supported))
    return out
