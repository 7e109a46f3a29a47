"""Model families pdserve implements, by the ``architectures`` name of their HF config."""

from __future__ import annotations

import torch

from pdserve.engine.backends.base import Backend
from pdserve.engine.models.llama import LlamaForCausalLM

MODELS = {"LlamaForCausalLM": LlamaForCausalLM, "Qwen2ForCausalLM": LlamaForCausalLM}


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture is not one pdserve implements."""


def architecture(config, model: torch.nn.Module | None = None) -> str:
    """The architecture name: the loaded model's class, else the config's ``architectures``."""
    if model is not None:
        return type(model).__name__
    names = getattr(config, "architectures", None) or [type(config).__name__]
    return names[0]


def check_supported(config, model: torch.nn.Module | None = None) -> None:
    """Raises UnsupportedModelError naming the architecture and the supported list."""
    arch = architecture(config, model)
    if arch not in MODELS:
        raise UnsupportedModelError(f"model architecture {arch!r} is not implemented by pdserve's engine; "
                                    f"supported: {', '.join(sorted(MODELS))}")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"{arch} with hidden_act={config.hidden_act!r}: pdserve's engine implements silu")


def build_model(hf_model: torch.nn.Module, backend: Backend, max_positions: int, quantized: dict | None = None):
    """pdserve's model over ``backend``, with ``hf_model``'s weights (and ``quantized``: the
    same in GGUF blocks by parameter name, engine/quantized.py). Raises UnsupportedModelError."""
    check_supported(hf_model.config, hf_model)
    return MODELS[architecture(hf_model.config, hf_model)](hf_model, backend, max_positions, quantized)
