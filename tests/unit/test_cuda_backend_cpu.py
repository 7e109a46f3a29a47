"""The ``cuda`` backend's own code (pdserve/engine/backends/cuda.py) on the CPU device.

``backends.resolve`` refuses ``cuda`` off a GPU unless a test sets TEST_CUDA_ON_CPU_ENV, as
every test here does: the engine then runs CudaBackend on the CPU, and its greedy ids must
equal model.generate's token for token (float32, tiny Llama and Qwen2), and each sampled
token's logprob the reference's within LOGPROB_ATOL: these random-weight models' greedy ids
alone survived an attention mask that hid each chunk row from itself. An SDPA spy in the
backend's module records which attention paths ran, so a workload that stops reaching one
(a whole prompt, a chunk after cached tokens under its offset mask, the gathered padded
decode) fails here instead of passing untested. Graph capture and GPU numerics run on a GPU
only (tests/gpu/test_gpu.py).
"""

import pytest
import torch
import torch.nn.functional

from conftest import reference_generate, tiny_model
from pdserve.engine import backends
from pdserve.engine.backends import cuda
from pdserve.engine.backends.cuda import CudaBackend
from pdserve.engine.engine import Engine, EngineConfig
from pdserve.engine.sequence import Sequence
from pdserve.sampling import SamplingParams
from test_engine import EOS, assert_all_blocks_free, random_prompts, run_to_completion

# float32 on the CPU: batched matmuls and SDPA round unlike HF's one-sequence forward by ~1e-6;
# a wrong mask or a misplaced K/V moves a logprob by orders of magnitude more
LOGPROB_ATOL = 1e-4


class AttentionSpy:
    """Stands in for ``torch.nn.functional`` in cuda.py: counts the SDPA calls by path."""

    def __init__(self):
        self.calls = {"causal": 0, "offset_mask": 0, "decode_mask": 0, "one_token": 0}
        self.gathers = {"new": 0, "workspace": 0}

    def __getattr__(self, name):
        return getattr(torch.nn.functional, name)

    def scaled_dot_product_attention(self, q, k, v, attn_mask=None, is_causal=False, **kwargs):
        if attn_mask is not None:  # [1, 1, new, context] for a chunk, [batch, 1, 1, blocks * bs] for decode
            self.calls["offset_mask" if attn_mask.shape[2] > 1 else "decode_mask"] += 1
        else:
            self.calls["causal" if is_causal else "one_token"] += 1
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kwargs)


@pytest.fixture
def spy(monkeypatch):
    monkeypatch.setenv(backends.TEST_CUDA_ON_CPU_ENV, "1")
    spy = AttentionSpy()
    monkeypatch.setattr(cuda, "F", spy)
    gather = cuda.gather_blocks

    def counting_gather(blocks, block_ids, out=None):
        spy.gathers["new" if out is None else "workspace"] += 1
        return gather(blocks, block_ids, out)

    monkeypatch.setattr(cuda, "gather_blocks", counting_gather)
    return spy


def generate_all(engine: Engine, prompts, max_tokens: int) -> list[Sequence]:
    """test_engine's, with each sampled token's logprob recorded."""
    seqs = [Sequence(f"r{i}", list(p), len(p), SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=0))
            for i, p in enumerate(prompts)]
    for seq in seqs:
        engine.add(seq)
    run_to_completion(engine)
    return seqs


def assert_equals_reference(reference, seq: Sequence, prompt: list[int], max_tokens: int) -> None:
    """Greedy ids as model.generate's, token for token; each logprob as the reference's in
    one forward over prompt and output."""
    output = seq.token_ids[len(prompt):]
    assert output == reference_generate(reference, prompt, max_tokens, ignore_eos=True)
    with torch.inference_mode():
        logits = reference(torch.tensor([prompt + output])).logits[0, len(prompt) - 1:-1].float()
    want = torch.log_softmax(logits, -1)[torch.arange(len(output)), torch.tensor(output)]
    got = torch.tensor([lp.logprob for lp in seq.logprobs])
    torch.testing.assert_close(got, want, atol=LOGPROB_ATOL, rtol=0)


def cuda_engine(model, max_len: int = 512, **config) -> Engine:
    engine = Engine(model, EngineConfig(backend="cuda", **config), EOS, max_len)
    assert type(engine.backend) is CudaBackend and engine.kv_cache.device.type == "cpu"
    return engine


def test_cuda_is_refused_off_a_gpu_without_the_test_switch(monkeypatch):
    monkeypatch.delenv(backends.TEST_CUDA_ON_CPU_ENV, raising=False)
    with pytest.raises(ValueError, match="backend 'cuda' needs the model on a GPU, not cpu"):
        backends.resolve("cuda", torch.float32, torch.device("cpu"))
    monkeypatch.setenv(backends.TEST_CUDA_ON_CPU_ENV, "1")
    assert backends.resolve("cuda", torch.float32, torch.device("cpu")) == "cuda"
    assert backends.resolve("auto", torch.float32, torch.device("cpu")) != "cuda"  # the switch never picks cuda itself


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "phi3", "mixtral", "qwen3_moe", "llama3_rope", "mistral_window", "gemma2", "gemma3",
                                    "deepseek_v2"])
def test_batched_chunked_prefill_and_decode_equal_generate(family, spy):
    model, reference = tiny_model(family), tiny_model(family)
    engine = cuda_engine(model, num_blocks=128, block_size=4, max_num_batched_tokens=64, chunk_size=16)
    prompts = random_prompts([1, 5, 16, 17, 40, 3, 64, 9])
    seqs = generate_all(engine, prompts, 12)
    for seq, prompt in zip(seqs, prompts):
        assert_equals_reference(reference, seq, prompt, 12)
        assert seq.finish_reason == "length"
    assert engine.num_steps < 8 * 12  # sequences shared forwards
    if family in ("mistral_window", "gemma2", "deepseek_v2"):  # every layer windowed, soft-capped or latent: torch rows, no masks
        return
    # whole prompts, later 16-token chunks of the 17-, 40- and 64-token prompts, decode rows
    # beside prompt chunks, and decode-only steps through the gathered padded batch
    assert all(spy.calls.values()), spy.calls
    assert spy.gathers["new"] > 0 and spy.gathers["workspace"] == 0  # no graphs: fresh gathers
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_prefix_cache_hit_runs_the_offset_mask_and_equals_generate(family, spy):
    model, reference = tiny_model(family), tiny_model(family)
    engine = cuda_engine(model, num_blocks=64, block_size=4)
    prompt = random_prompts([41])[0]
    assert_equals_reference(reference, generate_all(engine, [prompt], 8)[0], prompt, 8)
    # a prompt sharing the first 9 tokens: 2 blocks cached, its other 21 tokens one chunk after them
    other = prompt[:9] + random_prompts([20], seed=5)[0]
    spy.calls["offset_mask"] = 0
    third = generate_all(engine, [other], 4)[0]
    assert third.num_cached_tokens == 8
    assert spy.calls["offset_mask"] == model.config.num_hidden_layers  # that one chunk, in every layer
    assert_equals_reference(reference, third, other, 4)
    assert_all_blocks_free(engine)


def test_preemption_recomputes_and_still_equals_generate(spy):
    model, reference = tiny_model("llama"), tiny_model("llama")
    # 20 blocks x 4 tokens = 80 slots for six sequences of up to 70 tokens each.
    engine = cuda_engine(model, num_blocks=20, block_size=4, max_num_batched_tokens=64, chunk_size=64)
    prompts = random_prompts([30, 25, 40, 33, 20, 28], seed=1)
    seqs = generate_all(engine, prompts, 30)
    assert engine.scheduler.num_preemptions > 0
    for seq, prompt in zip(seqs, prompts):
        assert_equals_reference(reference, seq, prompt, 30)
    assert spy.calls["decode_mask"] > 0
    assert_all_blocks_free(engine)


def test_padded_static_decode_steps_gather_into_the_workspaces_and_equal_generate(spy):
    """``cuda_graphs=True`` on the CPU: the padded static-shape decode steps a graph would
    record, run eagerly, gathering into DecodeGraphs' workspaces."""
    model, reference = tiny_model("qwen2"), tiny_model("qwen2")
    engine = cuda_engine(model, 128, num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, chunk_size=32, cuda_graphs=True)
    graphs = engine.runner.graphs
    assert graphs is not None and not graphs.capture
    prompts = random_prompts([1, 5, 6, 13, 40, 3, 70], seed=3)  # 7 sequences: padded to 8
    engine.kv_cache.k.normal_()  # garbage where no sequence wrote: masked out, never read
    seqs = generate_all(engine, prompts, 10)
    for seq, prompt in zip(seqs, prompts):
        assert_equals_reference(reference, seq, prompt, 10)
    assert (8, 32) in graphs.steps and graphs.failed is None
    assert spy.gathers["workspace"] > 0 and spy.calls["decode_mask"] > 0
    assert_all_blocks_free(engine)
