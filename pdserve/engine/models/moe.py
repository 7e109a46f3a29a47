"""Mixture-of-experts families: ``MixtralForCausalLM`` (the Llama layer with every
feed-forward an MoE, top-k weights renormalized) and ``Qwen3MoeForCausalLM`` (Qwen3's layer,
its q/k norms, with an MoE where ``decoder_sparse_step`` and ``mlp_only_layers`` say, the
weights renormalized per ``norm_topk_prob``, a dense feed-forward elsewhere). The experts are
engine/layers/moe.py's; both run op by op (the fused cpu decoder has no experts).
"""

from __future__ import annotations

import logging

from pdserve.engine.layers.moe import MoE
from pdserve.engine.models.llama import DecoderLayer, LlamaForCausalLM
from pdserve.engine.models.qwen3 import Qwen3DecoderLayer

log = logging.getLogger(__name__)


class _MoELayer:
    """A decoder layer whose feed-forward is an MoE (``is_moe``) or dense, mixed into a family's layer."""

    def init_mlp(self, linear, params, prefix: str, cfg) -> None:
        self.is_moe = self.uses_moe(cfg)
        if not self.is_moe:
            super().init_mlp(linear, params, prefix, cfg)
            return
        self.moe = MoE(self.backend, params[prefix + "gate.weight"], params[prefix + "experts.gate_up_proj"],
                       params[prefix + "experts.down_proj"], cfg.num_experts_per_tok, self.renormalize(cfg),
                       self.WEIGHTS_IN_MODEL_DTYPE, prefix.rstrip("."))

    def mlp(self, x):
        return self.moe(x) if self.is_moe else super().mlp(x)

    def linears(self):
        return [self.qkv, self.o_proj, *self.moe.linears()] if self.is_moe else super().linears()


class MixtralDecoderLayer(_MoELayer, DecoderLayer):
    WEIGHTS_IN_MODEL_DTYPE = False

    def uses_moe(self, cfg) -> bool:
        return True

    def renormalize(self, cfg) -> bool:
        return True


class Qwen3MoeDecoderLayer(_MoELayer, Qwen3DecoderLayer):
    WEIGHTS_IN_MODEL_DTYPE = True

    def uses_moe(self, cfg) -> bool:  # as HF's Qwen3MoeDecoderLayer decides
        return self.index not in cfg.mlp_only_layers and cfg.num_experts > 0 and (self.index + 1) % cfg.decoder_sparse_step == 0

    def renormalize(self, cfg) -> bool:
        return bool(cfg.norm_topk_prob)


class MixtralForCausalLM(LlamaForCausalLM):
    """pdserve's model for ``MixtralForCausalLM`` checkpoints."""

    layer_class = MixtralDecoderLayer
    fusable = False


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """pdserve's model for ``Qwen3MoeForCausalLM`` checkpoints."""

    layer_class = Qwen3MoeDecoderLayer
    fusable = False
