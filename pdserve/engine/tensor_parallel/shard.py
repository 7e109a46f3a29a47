"""One tensor-parallel rank's share of a checkpoint (Megatron-LM's split, Shoeybi et al. 2019,
sec. 3): the model code is unchanged, it reads a config with the rank's head and feed-forward
counts and tensors cut to match.

    q_proj, k_proj, v_proj (or fused qkv_proj)   rows: the rank's query heads, and the KV heads
                                                 they read (column parallel)
    o_proj                                       columns: the rank's query heads (row parallel;
                                                 the bias on rank 0 only)
    gate_proj, up_proj (or fused gate_up_proj)   rows: the rank's share of the intermediate size
    down_proj                                    columns: the same share (row parallel)
    embed_tokens, lm_head                        rows: the rank's range of the vocabulary
    experts.gate_up_proj [E, 2 I, H]             every expert's gate and up rows of the rank's
                                                 share of the expert intermediate size
    experts.down_proj [E, H, I]                  the same share of every expert's columns (the
                                                 layer's sum over experts, then one all-reduce)
    anything else (norms, q/k norms, the router) whole, on every rank

KV heads split across ranks; with fewer KV heads than ranks, each rank keeps the one KV head
its query heads read (replicated: ranks sharing it compute and store the same bits).
"""

from __future__ import annotations

import copy

import torch

from pdserve.engine.checkpoint import Checkpoint
from pdserve.engine.models.config import UnsupportedModelError

DENSE_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM",
                       "Gemma2ForCausalLM", "Gemma3ForCausalLM")
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen3MoeForCausalLM")  # every rank holds every expert's share
SPLIT_ARCHITECTURES = DENSE_ARCHITECTURES + MOE_ARCHITECTURES


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def expert_intermediate(config) -> int:
    """An expert's intermediate size: Qwen3-MoE's ``moe_intermediate_size``, else Mixtral's ``intermediate_size``."""
    return getattr(config, "moe_intermediate_size", None) or config.intermediate_size


def check_tensor_parallel(config, architecture: str, world: int) -> None:
    """Raises UnsupportedModelError, in one line, where ``world`` ranks cannot split the model."""
    if world == 1:
        return
    if architecture not in SPLIT_ARCHITECTURES:
        raise UnsupportedModelError(f"tensor_parallel_size {world}: pdserve splits {', '.join(SPLIT_ARCHITECTURES)}, "
                                    f"not {architecture} (latent attention runs on one rank)")
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    if heads % world:
        raise UnsupportedModelError(f"tensor_parallel_size {world} does not divide the model's {heads} attention heads")
    if kv % world and world % kv:
        raise UnsupportedModelError(f"tensor_parallel_size {world}: the model's {kv} KV heads neither divide among nor "
                                    f"replicate over {world} ranks")
    if config.intermediate_size % world:
        raise UnsupportedModelError(f"tensor_parallel_size {world} does not divide the model's intermediate size {config.intermediate_size}")
    if architecture in MOE_ARCHITECTURES and expert_intermediate(config) % world:
        raise UnsupportedModelError(f"tensor_parallel_size {world} does not divide the model's expert intermediate size "
                                    f"{expert_intermediate(config)}")


def vocab_ranges(vocab: int, world: int) -> list[tuple[int, int]]:
    """Each rank's [lo, hi) of the vocabulary: ceil(vocab / world) rows each, the last the rest."""
    per = -(-vocab // world)
    return [(min(r * per, vocab), min((r + 1) * per, vocab)) for r in range(world)]


def kv_head_range(config, rank: int, world: int) -> tuple[int, int]:
    """The KV heads rank ``rank`` keeps, [lo, hi)."""
    kv = config.num_key_value_heads
    if kv >= world:
        return rank * kv // world, (rank + 1) * kv // world
    first = rank * kv // world  # the KV head of the rank's query heads
    return first, first + 1


class ShardedCheckpoint(Checkpoint):
    def __init__(self, inner: Checkpoint, rank: int, world: int):
        """Rank ``rank`` of ``world`` over the whole checkpoint ``inner``. Raises
        UnsupportedModelError where the model does not split (check_tensor_parallel)."""
        full = inner.config
        check_tensor_parallel(full, inner.architecture, world)
        self.inner, self.rank, self.world = inner, rank, world
        self.dtype, self.device, self.architecture = inner.dtype, inner.device, inner.architecture
        self.generation_config = inner.generation_config
        self.d = head_dim(full)
        self.heads = full.num_attention_heads // world
        self.kv_lo, self.kv_hi = kv_head_range(full, rank, world)
        self.inter = full.intermediate_size // world
        self.expert_inter = expert_intermediate(full) // world
        self.vocab_lo, self.vocab_hi = vocab_ranges(full.vocab_size, world)[rank]
        self.full = full
        self.config = cfg = copy.deepcopy(full)
        cfg.num_attention_heads, cfg.num_key_value_heads = self.heads, self.kv_hi - self.kv_lo
        cfg.head_dim, cfg.intermediate_size = self.d, self.inter
        if getattr(cfg, "moe_intermediate_size", None):
            cfg.moe_intermediate_size = self.expert_inter

    def _q(self, t: torch.Tensor) -> torch.Tensor:  # rows of the rank's query heads
        return t[self.rank * self.heads * self.d : (self.rank + 1) * self.heads * self.d]

    def _kv(self, t: torch.Tensor) -> torch.Tensor:  # rows of its KV heads
        return t[self.kv_lo * self.d : self.kv_hi * self.d]

    def _ff(self, t: torch.Tensor) -> torch.Tensor:  # rows of its share of the intermediate size
        return t[self.rank * self.inter : (self.rank + 1) * self.inter]

    def get(self, name):
        t = self.inner.get(name)
        if t is None:
            return None
        cut = self._cut(name, t)
        return cut.contiguous() if cut is not t else t

    def _cut(self, name: str, t: torch.Tensor) -> torch.Tensor:
        share = slice(self.rank * self.expert_inter, (self.rank + 1) * self.expert_inter)
        if name.endswith("experts.gate_up_proj"):  # [E, gate rows | up rows, H]
            gate, up = t.chunk(2, dim=1)
            return torch.cat([gate[:, share], up[:, share]], dim=1)
        if name.endswith("experts.down_proj"):  # [E, H, I]
            return t[:, :, share]
        bias = name.endswith(".bias")
        part = name.split(".")[-2] if "." in name else name  # "model.layers.0.self_attn.q_proj.weight" -> "q_proj"
        if part == "q_proj":
            return self._q(t)
        if part in ("k_proj", "v_proj"):
            return self._kv(t)
        if part == "qkv_proj":  # [q heads | kv heads | kv heads]
            q, k, v = torch.split(t, [self.full.num_attention_heads * self.d, self.full.num_key_value_heads * self.d,
                                      self.full.num_key_value_heads * self.d])
            return torch.cat([self._q(q), self._kv(k), self._kv(v)])
        if part in ("gate_proj", "up_proj"):
            return self._ff(t)
        if part == "gate_up_proj":  # [gate | up]
            gate, up = t.chunk(2)
            return torch.cat([self._ff(gate), self._ff(up)])
        if part in ("o_proj", "down_proj"):
            if bias:
                return t if self.rank == 0 else torch.zeros_like(t)
            width = self.heads * self.d if part == "o_proj" else self.inter
            return t[:, self.rank * width : (self.rank + 1) * width]
        if part in ("embed_tokens", "lm_head"):
            return t[self.vocab_lo : self.vocab_hi]
        return t

    def rotary_emb(self):
        return self.inner.rotary_emb()

    def weights_hash(self):
        return self.inner.weights_hash()

    def nbytes(self):
        return self.inner.nbytes() // self.world + 1
