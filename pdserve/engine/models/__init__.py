"""Model families pdserve implements, by the ``architectures`` name of their HF config."""

from __future__ import annotations

from pdserve.engine.backends.base import Backend
from pdserve.engine.checkpoint import Checkpoint, config_architecture
from pdserve.engine.models.config import UnsupportedModelError, rope_parameter_sets
from pdserve.engine.models.deepseek import DeepseekV2ForCausalLM
from pdserve.engine.models.gemma import Gemma2ForCausalLM
from pdserve.engine.models.llama import LlamaForCausalLM
from pdserve.engine.models.moe import MixtralForCausalLM, Qwen3MoeForCausalLM
from pdserve.engine.models.phi3 import Phi3ForCausalLM
from pdserve.engine.models.qwen3 import Qwen3ForCausalLM

MODELS = {"DeepseekV2ForCausalLM": DeepseekV2ForCausalLM, "Gemma2ForCausalLM": Gemma2ForCausalLM, "Gemma3ForCausalLM": Gemma2ForCausalLM, "LlamaForCausalLM": LlamaForCausalLM, "MistralForCausalLM": LlamaForCausalLM, "MixtralForCausalLM": MixtralForCausalLM,
          "Phi3ForCausalLM": Phi3ForCausalLM, "Qwen2ForCausalLM": LlamaForCausalLM, "Qwen3ForCausalLM": Qwen3ForCausalLM,
          "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM}
# rope types whose table does not depend on the sequence's length: rotary.py evaluates HF's
# once for every position, and "longrope", which switches between two by the length
# (layers/rotary.py LongRopeRotary); "dynamic" recomputes its table with the length: not implemented
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def architecture(config, model=None) -> str:
    """The architecture name: the checkpoint's or loaded model's, else the config's ``architectures``."""
    if isinstance(model, Checkpoint):
        return model.architecture
    if model is not None:
        return type(model).__name__
    return config_architecture(config)


def check_supported(config, model=None, max_len: int | None = None) -> None:
    """Raises UnsupportedModelError naming the architecture and the supported list, or the
    feature of a supported one that the engine does not implement. ``max_len``: the context
    served (tokens; unused: every feature implemented is so at any length)."""
    arch = architecture(config, model)
    if arch not in MODELS:
        raise UnsupportedModelError(f"model architecture {arch!r} is not implemented by pdserve's engine; "
                                    f"supported: {', '.join(sorted(MODELS))}")
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
    if act not in MODELS[arch].activations:
        raise UnsupportedModelError(f"{arch} with activation {act!r}: pdserve's engine implements {', '.join(MODELS[arch].activations)} for it")
    MODELS[arch].check_config(config)  # the family's own features (raises UnsupportedModelError)
    for params in rope_parameter_sets(config):
        kind = params.get("rope_type") or params.get("type") or "default"
        if kind not in ROPE_TYPES:
            raise UnsupportedModelError(f"{arch} with rope type {kind!r}: pdserve's engine implements {', '.join(ROPE_TYPES)}")
        if kind == "longrope" and not (params.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings", None)):
            raise UnsupportedModelError(f"{arch} with rope type 'longrope' but no original_max_position_embeddings: where it switches tables is unknown")
        if params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) != 1.0:
            raise UnsupportedModelError(f"{arch} with a partial rotary: pdserve's engine rotates whole heads")


def build_model(model, backend: Backend, max_positions: int, quantized: dict | None = None):
    """pdserve's model over ``backend``, with the weights of ``model`` (a Checkpoint, or a
    loaded transformers model) and ``quantized``: the same in GGUF blocks by parameter name
    (engine/quantized.py). Raises UnsupportedModelError, CheckpointError."""
    checkpoint = Checkpoint.of(model)
    check_supported(checkpoint.config, checkpoint, max_positions)
    return MODELS[checkpoint.architecture](checkpoint, backend, max_positions, quantized)
