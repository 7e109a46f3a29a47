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
from collections import Counter
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


def read_quantized(path: Path, config, supported: set[int]) -> dict[str, QuantizedWeight]:
    """The linear layers' weights of the GGUF at ``path`` whose block type is in ``supported``
    (ggml type numbers), by HF parameter name; ``config``: the HF model config (head counts).
    Other quantized types are left to the de-quantized model, and logged by name."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch_field = reader.fields.get("general.architecture")
    arch = bytes(arch_field.parts[arch_field.data[0]]).decode() if arch_field is not None else ""
    out: dict[str, QuantizedWeight] = {}
    left: Counter[str] = Counter()
    for t in reader.tensors:
        name, kind = hf_name(t.name), t.tensor_type.name
        if name is None or kind in _DENSE:
            continue
        if int(t.tensor_type) not in supported:
            left[kind] += 1
            continue
        data = np.array(t.data, copy=True)  # [N, row bytes]
        if arch == "llama" and (".attn_q." in t.name or ".attn_k." in t.name):
            heads = config.num_attention_heads if ".attn_q." in t.name else config.num_key_value_heads
            data = np.ascontiguousarray(_unpermute_rows(data, heads))
        out[name] = QuantizedWeight(int(t.tensor_type), torch.from_numpy(data), int(t.shape[1]), int(t.shape[0]))
    if "lm_head.weight" not in out and "model.embed_tokens.weight" in out and getattr(config, "tie_word_embeddings", False):
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    if left:
        log.info("%s: %s left de-quantized (the quantized kernels take %s)", path.name,
                 ", ".join(f"{n} tensors of {k}" for k, n in sorted(left.items())), sorted(supported))
    return out
