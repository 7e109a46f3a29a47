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
# Ray's workers at nice 0, as `pdserve up` starts its Ray (pdserve/cli.py): at Ray's default of
# 15 every replica yields its core to the tests' own client threads.
os.environ.setdefault("RAY_worker_niceness", "0")


def tiny_model(family: str, seed: int = 0):
    """A tiny random-weight causal LM (float32) of the given family: "llama" or "qwen2"."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    torch.manual_seed(seed)
    common = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    config = {"llama": LlamaConfig, "qwen2": Qwen2Config}[family](**common)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").eval()


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
    from pdserve.deploy import deploy

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
    """A throwaway CA and a server certificate for 127.0.0.1 (openssl CLI), under ``tmp_path``: (cert, key, ca)."""
    import shutil
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make a test certificate")
    run = lambda *a: subprocess.run(["openssl", *a], check=True, capture_output=True, cwd=tmp_path)  # noqa: E731
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", "/CN=pdserve-test-ca")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "kv.key", "-out", "kv.csr", "-subj", "/CN=127.0.0.1")
    (tmp_path / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    run("x509", "-req", "-in", "kv.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out", "kv.pem", "-days", "1", "-extfile", "san.ext")
    return str(tmp_path / "kv.pem"), str(tmp_path / "kv.key"), str(tmp_path / "ca.pem")
