"""Each model family's prefill and decode step, on the cpu and torch backends:
``bash bench/run.sh families``.

Every family gets a random checkpoint of the bundled model's shape (hidden 576, 9 heads, 3 KV
heads, intermediate 1536, vocab 49,152; 4 layers; the MoE families 4 experts of intermediate
768, 2 per token, so a token reads the dense feed-forward's bytes; DeepSeek-V2 a latent of 256 +
32 rope dims, heads of 64 + 32 dims, no q LoRA, and one shared expert of 768 beside them),
built from transformers' own config class, in this machine's default dtype. Per family and backend: one prefill of
``--prompt`` tokens (after one of another prompt) and the median decode step at batch 1 and 16. The ratio column is each
figure over Llama's on the same backend in the same run (Llama runs as one fused C call per
step on the cpu backend; the families with extra ops, a sliding window of 128 tokens
(``mistral_window``, Gemma's sliding layers) or soft-capping (Gemma 2) run op by op, their
attention in the cpu kernel and in torch rows on the torch backend). Writes
bench/out/families.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench import hardware
from pdserve.config import ClusterConfig
from pdserve.engine.engine import Engine, EngineConfig
from pdserve.engine.sequence import Sequence
from pdserve.model_loader import resolve_dtype
from pdserve.sampling import SamplingParams

SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=9,
             num_key_value_heads=3, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def checkpoint(family: str, dtype: torch.dtype):
    from transformers import (AutoModelForCausalLM, DeepseekV2Config, Gemma2Config, Gemma3TextConfig, LlamaConfig, MistralConfig, MixtralConfig,
                              Phi3Config, Qwen2Config, Qwen3Config, Qwen3MoeConfig)

    torch.manual_seed(0)
    moe = dict(num_experts_per_tok=2)
    config = {
        "llama": lambda: LlamaConfig(**SHAPE),
        "qwen2": lambda: Qwen2Config(**SHAPE),
        "qwen3": lambda: Qwen3Config(**SHAPE, head_dim=64),
        "mistral": lambda: MistralConfig(**SHAPE, head_dim=64, sliding_window=4096),
        "mistral_window": lambda: MistralConfig(**SHAPE, head_dim=64, sliding_window=128),
        "gemma2": lambda: Gemma2Config(**SHAPE, head_dim=64, query_pre_attn_scalar=64, sliding_window=128),
        "gemma3": lambda: Gemma3TextConfig(**SHAPE, head_dim=64, query_pre_attn_scalar=64, sliding_window=128),
        "phi3": lambda: Phi3Config(**SHAPE),
        "mixtral": lambda: MixtralConfig(**{**SHAPE, "intermediate_size": 768}, num_local_experts=4, **moe),
        "deepseek_v2": lambda: DeepseekV2Config(**{**SHAPE, "num_key_value_heads": 9}, q_lora_rank=None, kv_lora_rank=256, qk_nope_head_dim=64,
                                                qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                                                moe_intermediate_size=768, first_k_dense_replace=0, topk_method="greedy"),
        "qwen3_moe": lambda: Qwen3MoeConfig(**SHAPE, head_dim=64, num_experts=4, moe_intermediate_size=768, decoder_sparse_step=1,
                                            mlp_only_layers=[], norm_topk_prob=True, **moe),
    }[family]()
    return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager").eval()


def measure(family: str, backend: str, dtype: torch.dtype, prompt_len: int, steps: int) -> dict[str, float]:
    engine = Engine(checkpoint(family, dtype), EngineConfig(num_blocks=1024, block_size=16, backend=backend), frozenset(), 4096)
    ids = torch.randint(3, SHAPE["vocab_size"], (prompt_len,), generator=torch.Generator().manual_seed(1)).tolist()
    out = {}
    warm = Sequence("w", ids[::-1], prompt_len, SamplingParams(max_tokens=1))  # first-call costs (torch's per-shape kernels) before the timed prefill
    engine.add(warm)
    while engine.scheduler.has_work():
        engine.step()
    seq = Sequence("p", ids, prompt_len, SamplingParams(max_tokens=1))
    engine.add(seq)
    start = time.perf_counter()
    engine.step()
    out["prefill_s"] = time.perf_counter() - start
    for batch in (1, 16):
        seqs = [Sequence(f"b{i}", ids[: 32 + i], 32 + i, SamplingParams(max_tokens=steps + 1, ignore_eos=True)) for i in range(batch)]
        for s in seqs:
            engine.add(s)
        while any(s.num_generated == 0 for s in seqs):
            engine.step()
        times = []
        while engine.scheduler.has_work():
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        out[f"decode_b{batch}_ms"] = 1e3 * sorted(times)[len(times) // 2]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default="llama,qwen2,qwen3,mistral,mistral_window,phi3,mixtral,qwen3_moe,gemma2,gemma3,deepseek_v2")
    parser.add_argument("--backends", default="cpu,torch")
    parser.add_argument("--dtype", default="auto", help="auto: this machine's (bf16 with AVX512-BF16 or AMX, else float32)")
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="bench/out/families.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, resolve_dtype(ClusterConfig.from_dict({"model": {"dtype": args.dtype, "device": "cpu"}})))
    rows = {}
    for backend in args.backends.split(","):
        for family in args.families.split(","):
            rows[f"{family}/{backend}"] = measure(family, backend, dtype, args.prompt, args.steps)
            base = rows.get(f"llama/{backend}")
            ratio = {k: round(v / base[k], 2) for k, v in rows[f"{family}/{backend}"].items()} if base else {}
            print(f"{family:10s} {backend:6s} " + "  ".join(f"{k} {v:.4g}" for k, v in rows[f"{family}/{backend}"].items()) + f"   vs llama {ratio}", flush=True)
    result = {"machine": hardware.describe(), "dtype": str(dtype), "threads": args.threads, "prompt": args.prompt, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
