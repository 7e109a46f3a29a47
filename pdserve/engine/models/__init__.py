"""Model families pdserve implements, by the ``architectures`` name of their HF config."""

from __future__ import annotations

import torch

from pdserve.engine.backends.base import Backend
from pdserve.engine.models.llama import LlamaForCausalLM
from pdserve.engine.models.moe import MixtralForCausalLM, Qwen3MoeForCausalLM
from pdserve.engine.models.phi3 import Phi3ForCausalLM
from pdserve.engine.models.qwen3 import Qwen3ForCausalLM

MODELS = {"LlamaForCausalLM": LlamaForCausalLM, "MistralForCausalLM": LlamaForCausalLM, "MixtralForCausalLM": MixtralForCausalLM,
          "Phi3ForCausalLM": Phi3ForCausalLM, "Qwen2ForCausalLM": LlamaForCausalLM, "Qwen3ForCausalLM": Qwen3ForCausalLM,
          "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM}
# rope types whose table does not depend on the sequence's length: rotary.py evaluates HF's
# once for every position ("dynamic" and "longrope" change with the length: not implemented)
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture is not one pdserve implements."""


def architecture(config, model: torch.nn.Module | None = None) -> str:
    """The architecture name: the loaded model's class, else the config's ``architectures``."""
    if model is not None:
        return type(model).__name__
    names = getattr(config, "architectures", None)
    if names:
        return names[0]
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # no ``architectures``: its model type's

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(config, "model_type", ""), type(config).__name__)


def check_supported(config, model: torch.nn.Module | None = None, max_len: int | None = None) -> None:
    """Raises UnsupportedModelError naming the architecture and the supported list, or the
    feature of a supported one that the engine does not implement. ``max_len``: the context
    served (tokens); a sliding window shorter than it is refused (None: any window is)."""
    arch = architecture(config, model)
    if arch not in MODELS:
        raise UnsupportedModelError(f"model architecture {arch!r} is not implemented by pdserve's engine; "
                                    f"supported: {', '.join(sorted(MODELS))}")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"{arch} with hidden_act={config.hidden_act!r}: pdserve's engine implements silu")
    kind = rope_type(config)
    if kind not in ROPE_TYPES:
        raise UnsupportedModelError(f"{arch} with rope type {kind!r}: pdserve's engine implements {', '.join(ROPE_TYPES)}")
    rope = rope_parameters(config)
    if rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) != 1.0:
        raise UnsupportedModelError(f"{arch} with a partial rotary: pdserve's engine rotates whole heads")
    window = sliding_window(config)
    if window is not None and (max_len is None or window < max_len):
        raise UnsupportedModelError(f"{arch} with a sliding window of {window} tokens: pdserve's engine implements full attention, "
                                    f"the same up to the window: serve at most {window} tokens (model.max_model_len)")


def sliding_window(config) -> int | None:
    """The window (tokens) of the config's sliding-window attention, None where it has none
    (Qwen2/3 name one and leave it off: ``use_sliding_window``)."""
    window = getattr(config, "sliding_window", None)
    return window if window and getattr(config, "use_sliding_window", True) else None


def rope_parameters(config) -> dict:
    """The config's rope parameters: transformers 5's ``rope_parameters``, or the older ``rope_scaling`` dict ({} for none)."""
    for name in ("rope_parameters", "rope_scaling"):
        params = getattr(config, name, None)
        if isinstance(params, dict):
            return params
    return {}


def rope_type(config) -> str:
    """The config's rope scaling type ("default" when it has none)."""
    params = rope_parameters(config)
    return params.get("rope_type") or params.get("type") or "default"


def build_model(hf_model: torch.nn.Module, backend: Backend, max_positions: int, quantized: dict | None = None):
    """pdserve's model over ``backend``, with ``hf_model``'s weights (and ``quantized``: the
    same in GGUF blocks by parameter name, engine/quantized.py). Raises UnsupportedModelError."""
    check_supported(hf_model.config, hf_model, max_positions)
    return MODELS[architecture(hf_model.config, hf_model)](hf_model, backend, max_positions, quantized)
