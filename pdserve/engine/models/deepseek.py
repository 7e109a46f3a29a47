"""DeepSeek-V2 (``DeepseekV2ForCausalLM``), as transformers computes it (``modeling_deepseek_v2``):
multi-head latent attention (MLA; DeepSeek-AI 2024, arXiv:2405.04434 sec. 2.1) and DeepSeekMoE
feed-forwards with shared experts (sec. 2.2). Per layer, x = input_norm(h):

    q = q_b(q_norm(q_a(x))), or q_proj(x)             # [N, heads, nope + r]: q_nope | q_pe
    c, k_pe = split(kv_a(x)); c = kv_norm(c)         # the latent [N, R] and the shared rope key [N, r]
    q_pe, k_pe = q_pe * f_p, k_pe * f_p               # rope on complex pairs (x_2i, x_2i+1), float32, HF's table
    q_lat[h] = W_UK[h]^T q_nope[h]                    # [N, heads, R]: kv_b's key rows of head h, absorbed
    o_lat = attention over (c, k_pe) in the pool      # backends/base.py forward_latent: [N, heads, R]
    o[h] = W_UV[h] o_lat[h]                           # kv_b's value rows of head h: [N, heads, v]
    h = h + o_proj(o);  h = h + ffn(post_norm(h))

The KV cache is the latent, R + r elements per token and layer (kv_layout.py), so a P/D
hand-off moves it and no dense K/V. Every token, prompt or decode, runs the absorbed form
(HF expands K and V from the latent instead: the same sums, in another order), so a row's
bits do not depend on the step it is in. The feed-forward is a dense MLP in the first
``first_k_dense_replace`` layers, then an MoE: a float32 softmax router, top-k ``greedy`` or
``group_limited_greedy``, the weights times ``routed_scaling_factor`` (not renormalized), each
expert's output summed in id order, plus the shared experts' MLP. Attention runs in torch ops
row by row on every backend (logged once at load); the projections on the backend's kernels.
"""

from __future__ import annotations

import functools
import logging

import torch

from pdserve.engine.backends.base import Backend, StepMetadata
from pdserve.engine.checkpoint import Checkpoint
from pdserve.engine.layers import Linear, RMSNorm
from pdserve.engine.layers.moe import MoE
from pdserve.engine.models.config import UnsupportedModelError, rope_parameters
from pdserve.engine.models.llama import DecoderLayer, LlamaForCausalLM, fused_linear
from pdserve.engine.quantized import QuantizedWeight

log = logging.getLogger(__name__)


class InterleavedRotary:
    """DeepSeek's rope: consecutive pairs (x_2i, x_2i+1) as complex numbers times HF's
    ``freqs_cis`` (yarn's attention factor in it), in float32, cast back (HF's
    ``apply_rotary_emb``)."""

    def __init__(self, hf_rotary: torch.nn.Module, num_positions: int, device: torch.device):
        positions = torch.arange(num_positions, device=device)[None]
        with torch.no_grad():
            self.freqs = hf_rotary(torch.zeros(1, device=device), positions)[0]  # [P, r / 2] complex64

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [N, heads, r] -> rotated, same shape and dtype."""
        pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))  # [N, heads, r / 2]
        return torch.view_as_real(pairs * self.freqs[positions][:, None]).flatten(2).type_as(x)


class DeepseekMoE(MoE):
    """DeepSeek-V2's routed experts (``DeepseekV2TopkRouter``, ``DeepseekV2Moe``) and its shared ones."""

    def __init__(self, backend: Backend, params: Checkpoint, prefix: str, cfg, shared: tuple[Linear, Linear]):
        super().__init__(backend, params[prefix + "gate.weight"].float(), params[prefix + "experts.gate_up_proj"],
                         params[prefix + "experts.down_proj"], cfg.num_experts_per_tok, False, False, prefix.rstrip("."))
        self.method, self.groups, self.top_groups = cfg.topk_method, cfg.n_group, cfg.topk_group
        self.scaling = cfg.routed_scaling_factor
        self.shared = shared  # (gate_up, down): an MLP of moe_intermediate_size * n_shared_experts

    def linears(self) -> list[Linear]:
        return [*super().linears(), *self.shared]

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(self.router(x.float()), dim=-1)  # [N, E], the router in float32 as HF's
        if self.method == "group_limited_greedy":  # experts only from the top_groups groups of highest best score (else greedy)
            group_best = probs.view(x.shape[0], self.groups, -1).max(dim=-1).values  # [N, groups]
            keep = torch.zeros_like(group_best).scatter_(1, torch.topk(group_best, self.top_groups, dim=-1).indices, 1)
            probs = probs.masked_fill(~keep.bool().repeat_interleave(probs.shape[1] // self.groups, dim=1), 0.0)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        return weights * self.scaling, chosen

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, down = self.shared
        return super().__call__(x) + down(self.backend.silu_mul(gate_up(x)))


class MLADecoderLayer(DecoderLayer):
    def __init__(self, backend: Backend, params: Checkpoint, prefix: str, index: int, cfg, rotary: InterleavedRotary,
                 quantized: dict[str, QuantizedWeight]):
        self.backend, self.index, self.rotary = backend, index, rotary
        self.heads = cfg.num_attention_heads
        self.nope, self.rope, self.rank, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank, cfg.v_head_dim
        from transformers.modeling_rope_utils import yarn_apply_mscale  # HF's softmax scale, yarn's mscale_all_dim folded in

        self.scale = yarn_apply_mscale(cfg.rope_parameters, (self.nope + self.rope) ** -0.5)
        attn, mlp = prefix + "self_attn.", prefix + "mlp."
        linear = functools.partial(fused_linear, backend, params, quantized)
        if cfg.q_lora_rank is None:
            self.q_a, self.q_norm, self.q_b = None, None, linear([attn + "q_proj"])
        else:
            self.q_a, self.q_b = linear([attn + "q_a_proj"]), linear([attn + "q_b_proj"])
            self.q_norm = RMSNorm(backend, params[attn + "q_a_layernorm.weight"], 1e-6)  # DeepseekV2RMSNorm's default eps
        self.kv_a = linear([attn + "kv_a_proj_with_mqa"])
        self.kv_norm = RMSNorm(backend, params[attn + "kv_a_layernorm.weight"], 1e-6)
        kv_b = params[attn + "kv_b_proj.weight"].view(self.heads, self.nope + self.v_dim, self.rank)  # [heads, nope + v, R]
        self.absorb_k = [Linear(backend, kv_b[h, : self.nope].T.contiguous(), name=f"{attn}kv_b_proj.k{h}") for h in range(self.heads)]  # [R, nope]
        self.absorb_v = [Linear(backend, kv_b[h, self.nope :].contiguous(), name=f"{attn}kv_b_proj.v{h}") for h in range(self.heads)]  # [v, R]
        self.o_proj = linear([attn + "o_proj"])
        self.is_moe = index >= cfg.first_k_dense_replace
        if self.is_moe:
            self.moe = DeepseekMoE(backend, params, mlp, cfg, (linear([mlp + "shared_experts.gate_proj", mlp + "shared_experts.up_proj"]),
                                                              linear([mlp + "shared_experts.down_proj"])))
        else:
            self.init_mlp(linear, params, mlp, cfg)
        self.input_norm = RMSNorm(backend, params[prefix + "input_layernorm.weight"], cfg.rms_norm_eps)
        self.post_norm = RMSNorm(backend, params[prefix + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
        self.window = self.softcap = None

    def __call__(self, h: torch.Tensor, residual: torch.Tensor | None, meta: StepMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        n = h.shape[0]
        x, residual = self.input_norm(h, residual)  # [N, H]
        q = self.q_b(self.q_norm(self.q_a(x), None)[0]) if self.q_a is not None else self.q_b(x)
        q = q.view(n, self.heads, self.nope + self.rope)
        latent = self.kv_a(x)  # [N, R + r]
        c = self.kv_norm(latent[:, : self.rank].contiguous(), None)[0]  # [N, R]
        q_pe = self.rotary(q[..., self.nope :], meta.positions)  # [N, heads, r]
        k_pe = self.rotary(latent[:, None, self.rank :], meta.positions)[:, 0]  # [N, r]
        q_nope = q[..., : self.nope]
        q_lat = torch.stack([self.absorb_k[i](q_nope[:, i].contiguous()) for i in range(self.heads)], dim=1)  # [N, heads, R]
        o_lat = self.backend.forward_latent(self.index, q_lat, q_pe, c, k_pe, meta, self.scale)  # [N, heads, R]
        o = torch.cat([self.absorb_v[i](o_lat[:, i].contiguous()) for i in range(self.heads)], dim=1)  # [N, heads * v]
        x, residual = self.post_norm(self.o_proj(o), residual)
        return self.mlp(x), residual

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(x) if self.is_moe else super().mlp(x)

    def linears(self) -> list[Linear]:
        attention = [lin for lin in (self.q_a, self.q_b, self.kv_a) if lin is not None] + self.absorb_k + self.absorb_v + [self.o_proj]
        return attention + (self.moe.linears() if self.is_moe else [self.gate_up, self.down])


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    """pdserve's model for ``DeepseekV2ForCausalLM`` checkpoints."""

    layer_class = MLADecoderLayer
    fusable = False

    def __init__(self, checkpoint: Checkpoint, backend: Backend, max_positions: int, quantized: dict[str, QuantizedWeight] | None = None):
        super().__init__(checkpoint, backend, max_positions, quantized)
        log.info("DeepseekV2ForCausalLM: latent attention runs in torch ops row by row (backends/base.py forward_latent); "
                 "the projections on the %s backend", backend.name)
        self.torch_rows = ["latent attention"]
        self.no_graphs = ["latent attention runs in torch rows"]

    @classmethod
    def check_config(cls, config) -> None:
        kind = rope_parameters(config).get("rope_type", "default")
        if kind == "longrope":
            raise UnsupportedModelError("DeepseekV2ForCausalLM with rope type 'longrope': pdserve's engine implements default, linear, llama3, yarn for it")
        if config.topk_method not in ("greedy", "group_limited_greedy"):
            raise UnsupportedModelError(f"DeepseekV2ForCausalLM with topk_method {config.topk_method!r}: pdserve's engine implements greedy, "
                                        "group_limited_greedy")
        experts, groups, top = config.n_routed_experts, config.n_group, config.topk_group
        if config.topk_method == "group_limited_greedy" and not (
                isinstance(groups, int) and isinstance(top, int) and 0 < top <= groups and experts % groups == 0
                and config.num_experts_per_tok <= top * experts // groups):
            raise UnsupportedModelError(f"DeepseekV2ForCausalLM with group_limited_greedy over n_group={groups}, topk_group={top}: "
                                        f"needs 0 < topk_group <= n_group, n_group dividing the {experts} experts, and "
                                        f"num_experts_per_tok={config.num_experts_per_tok} of the groups kept")
        if getattr(config, "moe_layer_freq", None) not in (None, 1):
            raise UnsupportedModelError(f"DeepseekV2ForCausalLM with moe_layer_freq={config.moe_layer_freq}: pdserve's engine, as "
                                        "transformers, puts an MoE in every layer from first_k_dense_replace on")

    def make_rotary(self, checkpoint: Checkpoint, backend: Backend, max_positions: int) -> InterleavedRotary:
        return InterleavedRotary(checkpoint.rotary_emb(), max(max_positions, 1), self.device)
