"""What the model code reads from an HF config beyond its shapes: rope parameters and sliding windows."""

from __future__ import annotations


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture, or a feature of it, is not one pdserve implements."""


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


def rope_parameter_sets(config) -> list[dict]:
    """Each rope parameter set of the config: one, or one per layer type where it keys them
    so (Gemma 3: ``{"full_attention": {...}, "sliding_attention": {...}}``)."""
    params = rope_parameters(config)
    nested = [v for v in params.values() if isinstance(v, dict)]
    return nested if nested and len(nested) == len(params) else [params]


def layer_window(config, index: int) -> int | None:
    """Layer ``index``'s sliding window (tokens), or None for full attention: the config's
    window on the layers its ``layer_types`` mark ``sliding_attention``, or on every layer
    where it has no ``layer_types`` (Mistral, Mixtral)."""
    window = sliding_window(config)
    types = getattr(config, "layer_types", None)
    if window is None or (types is not None and types[index] != "sliding_attention"):
        return None
    return window
