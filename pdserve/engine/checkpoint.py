"""Checkpoint: what the engine's models read their weights, config and rotary table from.

Two sources, one interface (``config``, ``dtype``, ``device``, ``architecture``,
``params`` by HF parameter name, ``rotary_emb()``, ``weights_hash()``):

- ``SafetensorsCheckpoint``: a Hugging Face directory's ``*.safetensors`` files, read tensor
  by tensor with ``readinto`` straight into the buffer the engine keeps (fused QKV and
  gate-up rows land in one tensor; a dtype change goes through one tensor-sized scratch).
  Nothing is memory-mapped and no transformers model is built, so a replica's memory
  holds one copy of the weights at load (the serving path: ``model_loader.load_checkpoint``).
- ``ModuleCheckpoint``: a loaded transformers model's parameters (tests, benchmarks).

The safetensors format (github.com/huggingface/safetensors): an 8-byte little-endian
header length, a JSON header of ``{name: {dtype, shape, data_offsets: [begin, end]}}``,
then the data, offsets counted from the end of the header.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import struct
import sys
from collections.abc import Iterable
from pathlib import Path

import torch

SCRATCH_BYTES = 16 << 20  # a dtype change reads this much at a time
SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


class CheckpointError(ValueError):
    """A checkpoint lacks a tensor the model needs, or stores one this reader does not take."""


class Checkpoint:
    config = None
    generation_config = None  # transformers' GenerationConfig (its eos ids), or None
    dtype: torch.dtype
    device: torch.device
    architecture: str

    @staticmethod
    def of(model) -> "Checkpoint":
        """``model`` as a Checkpoint: itself, or a ModuleCheckpoint over a transformers model."""
        return model if isinstance(model, Checkpoint) else ModuleCheckpoint(model)

    def get(self, name: str) -> torch.Tensor | None:
        """The parameter ``name`` (HF's naming) in ``dtype`` on ``device``, or None."""
        raise NotImplementedError

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self.get(name)
        if t is None:
            raise CheckpointError(f"the checkpoint has no tensor {name!r} ({self.architecture})")
        return t

    def cat(self, names: list[str], transient: bool = False) -> torch.Tensor | None:
        """The named tensors concatenated along dim 0 (the absent ones skipped), or None if all
        are. ``transient``: the caller copies the result before its next call (a backend
        that packs a copy), so a reader may return it in a buffer it reuses."""
        found = [t for t in (self.get(n) for n in names) if t is not None]
        return torch.cat(found) if found else None

    def rotary_emb(self) -> torch.nn.Module:
        """transformers' rotary module for this config (rotary.py evaluates it per position)."""
        raise NotImplementedError

    def weights_hash(self) -> str:
        """blake2b over the parameters (names and bytes in ``dtype``), for the KV fingerprint."""
        raise NotImplementedError

    def nbytes(self) -> int:
        """Bytes of every parameter in ``dtype`` (a bound for what a model packs)."""
        raise NotImplementedError


class ModuleCheckpoint(Checkpoint):
    def __init__(self, model: torch.nn.Module):
        self.module, self.config, self.dtype = model, model.config, model.dtype
        self.generation_config = getattr(model, "generation_config", None)
        self.device = next(model.parameters()).device
        self.architecture = type(model).__name__
        self._params = dict(model.named_parameters(remove_duplicate=False))

    def get(self, name):
        return self._params.get(name)

    def rotary_emb(self):
        return self.module.get_decoder().rotary_emb

    def weights_hash(self):
        h = hashlib.blake2b(digest_size=16)
        for name, tensor in sorted(self.module.state_dict().items()):
            h.update(name.encode())
            t = tensor.detach().contiguous().cpu()
            h.update(t.view(torch.uint8).numpy() if t.numel() else b"")
        return h.hexdigest()

    def nbytes(self):
        return sum(p.numel() * p.element_size() for p in self.module.parameters())


def _read_header(path: Path) -> tuple[dict, int]:
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        if size > 1 << 28:
            raise CheckpointError(f"{path}: a safetensors header of {size} bytes")
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header, 8 + size


class SafetensorsCheckpoint(Checkpoint):
    # MoE checkpoints as transformers saves them, per architecture: the stored name of the
    # feed-forward (the module's "mlp."), and each fused expert tensor the MoE layer takes
    # ([E, rows, H]) as the per-expert tensors stacked in order
    MOE = {
        "MixtralForCausalLM": ("block_sparse_moe.", {"experts.gate_up_proj": ("w1", "w3"), "experts.down_proj": ("w2",)}),
        "Qwen3MoeForCausalLM": ("mlp.", {"experts.gate_up_proj": ("gate_proj", "up_proj"), "experts.down_proj": ("down_proj",)}),
        "DeepseekV2ForCausalLM": ("mlp.", {"experts.gate_up_proj": ("gate_proj", "up_proj"), "experts.down_proj": ("down_proj",)}),
    }

    def __init__(self, model_dir: Path, config, dtype: torch.dtype, device: str | torch.device = "cpu", generation_config=None):
        """model_dir: holds the ``*.safetensors`` file or shards; config: its transformers
        config; generation_config: its GenerationConfig (eos ids), or None. Raises
        CheckpointError where it has none, or a tensor of a dtype not in SAFETENSORS_DTYPES."""
        self.dir, self.config, self.dtype, self.device = Path(model_dir), config, dtype, torch.device(device)
        self.generation_config = generation_config
        self.architecture = config_architecture(config)
        index = self.dir / "model.safetensors.index.json"  # shards: the files the index names (not a stray copy beside them)
        if index.is_file():
            files = sorted({self.dir / f for f in json.loads(index.read_text())["weight_map"].values()})
        else:
            files = sorted(self.dir.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{self.dir} has no .safetensors files (pdserve loads safetensors and GGUF)")
        self._where: dict[str, tuple[Path, dict, int]] = {}
        for path in files:
            header, data_start = _read_header(path)
            for name, info in header.items():
                self._where[name] = (path, info, data_start)
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        self._tied = bool(getattr(text, "tie_word_embeddings", getattr(config, "tie_word_embeddings", False)))
        self._digests: dict[str, bytes] = {}
        self._files: dict[Path, object] = {}
        self._scratch: torch.Tensor | None = None
        self._staging: torch.Tensor | None = None  # transient loads: one buffer, faulted in once (fresh mappings per layer fault every page)

    def __getstate__(self) -> dict:
        """Picklable (a tensor-parallel rank re-opens the files): no open files or buffers."""
        return {**self.__dict__, "_files": {}, "_scratch": None, "_staging": None}

    def close(self) -> None:
        """Close the files and drop the scratch buffer (the weights read stay valid)."""
        self._scratch = self._staging = None
        for f in self._files.values():
            f.close()
        self._files.clear()

    def _shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._where[name][1]["shape"])

    def _read_into(self, name: str, out: torch.Tensor) -> None:
        """Read tensor ``name`` into ``out`` (CPU, contiguous, its shape), converting to out's
        dtype through a scratch of at most SCRATCH_BYTES."""
        path, info, data_start = self._where[name]
        begin, end = info["data_offsets"]
        if info["dtype"] not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{path.name}: {name} is {info['dtype']}; pdserve reads {', '.join(SAFETENSORS_DTYPES)}")
        stored = SAFETENSORS_DTYPES[info["dtype"]]
        if out.numel() * stored.itemsize != end - begin:
            raise CheckpointError(f"{path.name}: {name} holds {end - begin} bytes, not a {info['dtype']} {list(out.shape)}")
        f = self._files.get(path) or self._files.setdefault(path, open(path, "rb"))
        f.seek(data_start + begin)
        flat = out.view(-1)
        step = max(1, flat.numel() if stored == out.dtype else SCRATCH_BYTES // stored.itemsize)
        scratch = None
        if stored != out.dtype:  # one buffer for the whole load: per-tensor ones fragment the heap (+100 MB on the bundled model)
            if self._scratch is None:
                self._scratch = torch.empty(SCRATCH_BYTES, dtype=torch.uint8)
            scratch = self._scratch.view(stored)
        for start in range(0, flat.numel(), step):
            part = flat[start : start + step]
            target = part if scratch is None else scratch[: part.numel()]
            view = memoryview(target.view(torch.uint8).numpy())
            while len(view):  # readinto may return less than asked
                got = f.readinto(view)
                if not got:
                    raise CheckpointError(f"{path.name} ends inside {name}")
                view = view[got:]
            if target is not part:
                part.copy_(target)
        self._digests[name] = hashlib.blake2b(flat.view(torch.uint8).numpy(), digest_size=16).digest()

    def _load(self, names: list[str], transient: bool = False) -> torch.Tensor:
        """The stored tensors ``names`` stacked along dim 0 into one new tensor (same trailing
        dims); ``transient``: into the staging buffer, overwritten by the next such load."""
        shapes = [self._shape(n) for n in names]
        rows = sum(s[0] for s in shapes)
        shape = (rows, *shapes[0][1:])
        if transient and self.device.type == "cpu":
            numel = _numel(shape)
            if self._staging is None or self._staging.numel() < numel:  # grows to the largest layer, once per size
                self._staging = None
                self._staging = _empty((numel,), self.dtype)
            out = self._staging[:numel].view(shape)
        else:
            out = _empty(shape, self.dtype)
        start = 0
        for name, shape in zip(names, shapes):
            self._read_into(name, out[start : start + shape[0]])
            start += shape[0]
        return out.to(self.device) if self.device.type != "cpu" else out

    def _stored(self, name: str) -> tuple[list[str], int] | None:
        """The stored tensors that make up parameter ``name`` in order, and how many experts
        they stack (0: none), or None where the checkpoint has none."""
        if name in self._where:  # a stored LM head is used even where the config ties it (transformers 5 unties those)
            return [name], 0
        if name == "model.embed_tokens.weight" and self._tied and "lm_head.weight" in self._where:  # only the head stored
            return ["lm_head.weight"], 0
        if self.architecture not in self.MOE or ".mlp." not in name:
            return None
        stored_mlp, fused = self.MOE[self.architecture]
        renamed = name.replace(".mlp.", "." + stored_mlp, 1)
        if renamed in self._where:
            return [renamed], 0
        for suffix, parts in fused.items():
            if renamed.endswith(suffix):
                base = renamed[: -len(suffix)] + "experts."
                experts = sorted({int(k[len(base):].split(".")[0]) for k in self._where if k.startswith(base)})
                if experts:
                    return [f"{base}{e}.{p}.weight" for e in experts for p in parts], len(experts)
        return None

    def get(self, name):
        found = self._stored(name)
        if found is None:
            return None
        stored, experts = found
        out = self._load(stored)  # [sum of rows, ...]
        return out.view(experts, -1, out.shape[-1]) if experts else out

    def cat(self, names, transient=False):
        stored = [s for n in names for s in (self._stored(n) or ([], 0))[0]]
        return self._load(stored, transient) if stored else None

    def rotary_emb(self):
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        module = sys.modules[MODEL_FOR_CAUSAL_LM_MAPPING[type(self.config)].__module__]  # e.g. transformers...modeling_llama
        prefix = self.architecture.removesuffix("ForCausalLM")
        cls = getattr(module, prefix + "RotaryEmbedding", None) or next(
            getattr(module, n) for n in dir(module) if n.endswith("RotaryEmbedding"))
        return cls(config=self.config).to(self.device)

    def weights_hash(self):
        """Over the tensors read so far (each hashed as read, in ``dtype``), in name order."""
        h = hashlib.blake2b(digest_size=16)
        for name in sorted(self._digests):
            h.update(name.encode())
            h.update(self._digests[name])
        return h.hexdigest()

    def nbytes(self):
        return sum(self.dtype.itemsize * _numel(info["shape"]) for _, info, _ in self._where.values())

    def names(self) -> Iterable[str]:
        return self._where.keys()


def config_architecture(config) -> str:
    """The config's architecture: its ``architectures``, else transformers' causal LM class for its model type."""
    names = getattr(config, "architectures", None)
    if names:
        return names[0]
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(config, "model_type", ""), type(config).__name__)


def _empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized CPU tensor; from 1 MiB up in its own anonymous mapping, which goes
    back to the OS when the tensor is freed. From malloc's heap, the weights a layer packs
    and drops, between the small norms it keeps, left holes the next layer's did not fit:
    +44 MB over the bundled model's 310 MB at load."""
    nbytes = _numel(shape) * dtype.itemsize
    if nbytes < 1 << 20 or not hasattr(mmap, "MAP_ANONYMOUS"):
        return torch.empty(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)  # the tensor holds the mapping


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
