"""KVFingerprint: what must match for KV made by one worker to be valid in another.

Workers compute theirs at start (``pdserve.worker.build_engine``); prefill and decode
exchange them when a decode worker first reaches a prefill worker (kv_transfer's
``Handshake`` RPC, kv.proto). Decode refuses KV from a worker whose
fingerprint differs, with an error naming the first field that differs: the same
shapes with other weights, another tokenizer or another block size would give a
wrong answer with a success status.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass

from pdserve.errors import KVIncompatibleError
from pdserve.kv_layout import KVSpec


@dataclass(frozen=True)
class KVFingerprint:
    model_id: str  # the model's name or path as configured
    weights_hash: str  # blake2b of every parameter's bytes, in name order
    dtype: str  # KV dtype, e.g. "bfloat16"
    num_layers: int
    num_kv_heads: int
    head_dim: int  # elements
    block_size: int  # tokens per KV block
    tokenizer_hash: str  # blake2b of the tokenizer's vocabulary and special tokens

    @classmethod
    def of(cls, model, tokenizer, model_id: str, block_size: int) -> "KVFingerprint":
        """Hashes the weights (about 0.5 s per GB here) and the tokenizer."""
        spec = KVSpec.from_model_config(model.config, model.dtype)
        return cls(
            model_id=model_id,
            weights_hash=weights_hash(model),
            dtype=str(spec.dtype).removeprefix("torch."),
            num_layers=spec.num_layers,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            block_size=block_size,
            tokenizer_hash=tokenizer_hash(tokenizer),
        )

    def check(self, theirs: "KVFingerprint", peer: str) -> None:
        """Raise KVIncompatibleError naming the first field where ``theirs`` (at ``peer``) differs."""
        for field in dataclasses.fields(self):
            mine, other = getattr(self, field.name), getattr(theirs, field.name)
            if mine != other:
                raise KVIncompatibleError(
                    f"KV from {peer} is incompatible: {field.name} is {other!r} there but {mine!r} on this decode worker",
                    field.name,
                )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "KVFingerprint":
        return cls(**{f.name: values[f.name] for f in dataclasses.fields(cls)})


def weights_hash(model) -> str:
    """``model``: a Checkpoint (engine/checkpoint.py: hashed as read, so after the engine is
    built) or a transformers model (every parameter's bytes, in name order)."""
    from pdserve.engine.checkpoint import Checkpoint

    return Checkpoint.of(model).weights_hash()


def tokenizer_hash(tokenizer) -> str:
    payload = {"vocab": sorted(tokenizer.get_vocab().items()), "special": sorted(map(str, tokenizer.all_special_tokens))}
    return hashlib.blake2b(json.dumps(payload).encode(), digest_size=16).hexdigest()
