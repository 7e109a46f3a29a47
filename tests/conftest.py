"""Shared fixtures: tiny random-weight models for unit tests, the real model for end-to-end tests."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

# Ray 2.60 turns token authentication on for clusters that `ray start --head` makes but not
# for raylets joining them, and caches the mode per process: every Ray these tests start
# (local clusters, the multi-node test's raylets, `pdserve up`) runs without it.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# Ray's workers at nice 0, as `pdserve up` starts its Ray (pdserve_app/cli.py): at Ray's default of
# 15 every replica yields its core to the tests' own client threads.
os.environ.setdefault("RAY_worker_niceness", "0")

# The only reasons a test may skip. On a machine with a C compiler only the GPU ones may occur:
# any other skip fails the run (``pytest_sessionfinish`` below), so a broken kernel build or a
# missing test dependency cannot pass as green with skips.
NO_GPU = "no CUDA device here: the GPU tests run on a GPU node (bash scripts/test_gpu.sh)"
NO_TWO_GPUS = "needs two CUDA devices: prefill on one, decode on the other"
HAS_GPU = "this machine has a GPU: the test needs one without"
NO_CUPY = "cupy is missing on this GPU node: pip install 'pdserve[gpu]'"
GPU_SKIPS = (NO_GPU, NO_TWO_GPUS, HAS_GPU, NO_CUPY)
NO_COMPILER = "no C compiler found (cc, gcc or $CC): the engine runs the torch backend"


def require_kernels(*names: str) -> None:
    """Skip (NO_COMPILER) where no C compiler is found; where one is, fail with the build's
    message (the compiler's output) or the self-check's if a named kernel is unavailable.
    ``names``: the C libraries of pdserve/engine/cpu (linear, pointwise, attention, decoder,
    kv_blocks); the first three must also pass their self-check against torch."""
    from pdserve.engine import cpu
    from pdserve.engine.cpu import ops

    if cpu.compiler() is None:
        pytest.skip(NO_COMPILER)
    problems = [ops.problem(n) if n in ops.KERNELS else cpu.problem(n) for n in names]
    if any(problems):
        pytest.fail("a C kernel is unavailable on a machine with a compiler:\n" + "\n".join(p for p in problems if p), pytrace=False)


def _skip_reasons(terminalreporter) -> dict[str, int]:
    reasons: dict[str, int] = {}
    for report in terminalreporter.stats.get("skipped", []):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        reasons[reason] = reasons.get(reason, 0) + 1
    return reasons


def _forbidden_skips(reasons: dict[str, int]) -> dict[str, int]:
    """Skips that are not allowed here: any but the GPU ones, on a machine with a C compiler."""
    from pdserve.engine import cpu

    if cpu.compiler() is None:
        return {r: n for r, n in reasons.items() if r not in GPU_SKIPS and r != NO_COMPILER}
    return {r: n for r, n in reasons.items() if r not in GPU_SKIPS}


def pytest_sessionfinish(session, exitstatus):
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and exitstatus == 0 and _forbidden_skips(_skip_reasons(reporter)):
        session.exitstatus = 1  # the summary below names them


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    reasons = _skip_reasons(terminalreporter)
    if not reasons:
        return
    terminalreporter.section("skipped tests by reason")
    for reason, count in sorted(reasons.items(), key=lambda kv: -kv[1]):
        terminalreporter.line(f"{count:5d}  {reason}")
    forbidden = _forbidden_skips(reasons)
    if forbidden:
        terminalreporter.line(f"FAILED: {sum(forbidden.values())} test(s) skipped for a reason other than no GPU; "
                              "here every other test must run (tests/conftest.py, GPU_SKIPS)", red=True)


# rope scaling with a short original context, so that the prompts of the tests reach past it
ROPE_SCALING = {
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
}


def tiny_model(family: str, seed: int = 0, vocab_size: int = 256):
    """A tiny random-weight causal LM (float32) of the given family: "llama", "qwen2",
    "qwen3" (per-head q/k norms, head_dim 32 != hidden / heads), "mistral" (its window as
    long as the context), "phi3" (fused checkpoint projections), "phi3_longrope" (longrope, switched at 32 tokens), "mixtral" and "qwen3_moe" (experts), or "llama3_rope" /
    "yarn_rope" (Llama with that rope scaling, ROPE_SCALING), "mistral_window" (a window of 8 tokens), "gemma2" and
    "gemma3" (sliding and global layers, soft-capping), "deepseek_v2" (latent attention with a
    q LoRA and yarn's mscale, a dense layer then an MoE of 4 routed experts in 2 groups and a
    shared one), "deepseek_v2_lite" (no q LoRA, default rope, greedy routing). vocab_size: the bundled tokenizer's
    49,152 where a worker serves it (it loads the directory's tokenizer)."""
    from transformers import (AutoModelForCausalLM, DeepseekV2Config, Gemma2Config, Gemma3TextConfig, LlamaConfig, MistralConfig, MixtralConfig, Phi3Config,
                              Qwen2Config, Qwen3Config, Qwen3MoeConfig)

    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    if family == "qwen3":
        config = Qwen3Config(**common, head_dim=32)
    elif family == "mistral":  # a window as long as the context: the same as full attention, which the engine serves
        config = MistralConfig(**common, head_dim=32, sliding_window=512)
    elif family == "phi3":  # QKV and gate-up stored fused
        config = Phi3Config(**common)
    elif family == "phi3_longrope":  # a short and a long table, switched at 32 tokens; factors far enough apart to change ids
        half = common["hidden_size"] // common["num_attention_heads"] // 2
        config = Phi3Config(**common, original_max_position_embeddings=32, rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 32,
            "short_factor": [1.0 + 0.1 * i for i in range(half)], "long_factor": [2.0 + 0.5 * i for i in range(half)]})
    elif family == "mixtral":  # 4 experts, 2 per token
        config = MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)
    elif family == "qwen3_moe":  # layer 0 an MoE of 4 experts (2 per token, not renormalized), layer 1 dense
        config = Qwen3MoeConfig(**common, head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=False)
    elif family == "mistral_window":  # a window shorter than most prompts: attention over the last 8 positions
        config = MistralConfig(**common, head_dim=32, sliding_window=8)
    elif family == "gemma2":  # alternating sliding (8 tokens) and global layers, soft-capping that bites, a query scalar != head_dim
        config = Gemma2Config(**common, head_dim=16, query_pre_attn_scalar=24, sliding_window=8, attn_logit_softcapping=1.0, initializer_range=0.2,
                              final_logit_softcapping=3.0)
    elif family == "gemma3":  # q/k norms, a sliding layer with its own rope base, then a global one
        config = Gemma3TextConfig(**common, head_dim=32, query_pre_attn_scalar=24, sliding_window=8,
                                  layer_types=["sliding_attention", "full_attention"])
    elif family.startswith("deepseek_v2"):
        mla = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
                   n_shared_experts=1, moe_intermediate_size=32, **{**common, "num_key_value_heads": 4})
        if family == "deepseek_v2":
            config = DeepseekV2Config(**mla, q_lora_rank=24, first_k_dense_replace=1, topk_method="group_limited_greedy", n_group=2, topk_group=1,
                                      routed_scaling_factor=1.5, rope_parameters={
                                          "rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 32, "mscale": 0.707,
                                          "mscale_all_dim": 0.707, "rope_theta": 10000.0})
        else:
            config = DeepseekV2Config(**mla, q_lora_rank=None, first_k_dense_replace=0, topk_method="greedy")
    elif family.endswith("_rope"):
        config = LlamaConfig(**common, rope_scaling=ROPE_SCALING[family.removesuffix("_rope")])
    else:
        config = {"llama": LlamaConfig, "qwen2": Qwen2Config}[family](**common)
    attention = "eager" if family.startswith("gemma") else "sdpa"  # HF's sdpa path has no soft-capping
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attention).eval()
    with torch.no_grad():  # HF initializes norms to ones (Gemma's to zero) and may leave routers at zero: random, so a skipped one shows
        if family.startswith("gemma"):
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.normal_(0, 0.3)
        if family.startswith("deepseek"):
            for name, p in model.named_parameters():
                if "layernorm" in name:
                    p.uniform_(0.5, 1.5)
        for layer in model.model.layers:
            if hasattr(layer.self_attn, "q_norm"):
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
                layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
            if hasattr(layer.mlp, "gate") and hasattr(layer.mlp.gate, "weight") and layer.mlp.gate.weight.dim() == 2 and hasattr(layer.mlp, "experts"):
                layer.mlp.gate.weight.normal_(0, 0.5)
    return model


@contextlib.contextmanager
def all_cores():
    """torch's intra-op threads on every core this process may use, then back to the caller's
    count, for the HF references. Their bits did not depend on it (greedy ids and bf16
    logprobs the same on 1 and 2 threads), and they are much of the suite's time: a one-row
    forward of the bundled model in torch reads its weights at ~6 GB/s on one EPYC Zen 4 core.
    Two threads took test_e2e's 32 float32 references from 47 to 40 s and test_engine_real's
    24 bf16 ones from 63 to 42 s (2026-12-03). The engine under test keeps its own count."""
    before = torch.get_num_threads()
    torch.set_num_threads(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def reference_generate(model, prompt_ids: list[int], max_new_tokens: int, ignore_eos: bool = False, repetition_penalty: float = 1.0,
                       frequency_penalty: float = 0.0, presence_penalty: float = 0.0) -> list[int]:
    """Greedy ``model.generate`` output ids (prompt excluded), the single-process reference.

    ignore_eos: generate past EOS (as SamplingParams.ignore_eos), for exactly max_new_tokens.
    repetition_penalty: HF's own (over prompt and output; a power of 2 rounds as vLLM's
    multiply-by-reciprocal does). frequency / presence: OpenAI's definition over the output,
    applied after it (OutputPenalties), the order vLLM applies them in.
    """
    from transformers import GenerationConfig, LogitsProcessorList

    input_ids = torch.tensor([prompt_ids], device=next(model.parameters()).device)
    config = GenerationConfig(
        do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=model.config.pad_token_id,
        eos_token_id=[] if ignore_eos else model.generation_config.eos_token_id, repetition_penalty=repetition_penalty,
    )
    processors = LogitsProcessorList([OutputPenalties(len(prompt_ids), frequency_penalty, presence_penalty)] if frequency_penalty or presence_penalty else [])
    with all_cores():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config, logits_processor=processors)
    return out[0, len(prompt_ids):].tolist()


class OutputPenalties:
    """OpenAI's frequency and presence penalties as an HF logits processor: each token's
    logit minus ``frequency`` times its count in the output and ``presence`` once if it is there."""

    def __init__(self, num_prompt_tokens: int, frequency: float, presence: float):
        self.num_prompt_tokens, self.frequency, self.presence = num_prompt_tokens, frequency, presence

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        counts = torch.zeros_like(scores)
        for row, ids in enumerate(input_ids[:, self.num_prompt_tokens:]):
            counts[row].index_add_(0, ids, torch.ones(len(ids), dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0)


@pytest.fixture(scope="session")
def real_model_dir():
    from pdserve.model_loader import resolve_model_dir

    return resolve_model_dir("smollm2")


def serve_cluster(config: dict, api_key: str | None = None, client_kwargs: dict | None = None, **ray_init):
    """Generator for module fixtures: a local Ray (2 CPUs) with pdserve deployed from
    ``config`` (a cluster.yaml mapping); yields a Client on its gRPC port (sending
    ``api_key``, built with ``client_kwargs``: TLS files), then shuts all down."""
    import os

    import ray
    from ray import serve

    from pdserve.client import Client
    from pdserve.config import ClusterConfig
    from pdserve_app.deploy import deploy

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if ray.is_initialized():  # e.g. started implicitly by a worker class's metrics in an earlier test
        ray.shutdown()
    try:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, **ray_init)
    except RuntimeError as e:  # seen once in CI on this 2-core machine: the new GCS missed Ray's 30 s start deadline
        if "Timed out waiting for file" not in str(e):
            raise
        ray.shutdown()
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, **ray_init)
    cfg = ClusterConfig.from_dict(config)
    deploy(cfg)
    client = Client(f"127.0.0.1:{cfg.router.grpc_port}", api_key=api_key, **(client_kwargs or {}))
    client.health(timeout_s=30)
    yield client
    client.close()
    serve.shutdown()  # first: with ray.shutdown() alone, the next modules' clusters failed to start
    ray.shutdown()


def make_tls(tmp_path) -> tuple[str, str, str]:
    """A throwaway CA and a server certificate for 127.0.0.1 (with ``cryptography``), under
    ``tmp_path``: (cert, key, ca) PEM file paths (the certificate serves as a client's too)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def cert(subject: str, key, issuer: str, issuer_key, ca: bool):
        builder = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
                   .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)])).public_key(key.public_key())
                   .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if not ca:
            builder = builder.add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        return builder.sign(issuer_key, hashes.SHA256())

    ca_key, kv_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_cert = cert("pdserve-test-ca", ca_key, "pdserve-test-ca", ca_key, ca=True)
    kv_cert = cert("127.0.0.1", kv_key, "pdserve-test-ca", ca_key, ca=False)
    (tmp_path / "ca.pem").write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "kv.pem").write_bytes(kv_cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "kv.key").write_bytes(kv_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                           serialization.NoEncryption()))
    return str(tmp_path / "kv.pem"), str(tmp_path / "kv.key"), str(tmp_path / "ca.pem")
