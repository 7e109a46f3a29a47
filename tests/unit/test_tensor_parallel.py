"""Tensor parallelism inside one engine (pdserve/engine/tensor_parallel): ranks as real child
processes, collectives through shared memory. float32 greedy ids equal HF ``generate`` for
every dense and MoE family at TP=2, for 4 and 8 KV heads and for fewer KV heads than ranks
(replicated), and for the bundled model at TP=3; a needle is the same bits alone and in any
batch at TP=2; KV handed off P(TP=2) -> D(TP=1) and P(TP=1) -> D(TP=2) decodes to HF's ids;
what cannot split is refused in one line; a killed rank fails the step and the health check
by name, and nothing is left in /dev/shm."""

import glob
import os
import random
import signal

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import reference_generate, tiny_model
from pdserve.engine.engine import Engine, EngineConfig
from pdserve.engine.models import UnsupportedModelError
from pdserve.engine.sequence import Sequence
from pdserve.engine.tensor_parallel.shard import check_tensor_parallel
from pdserve.sampling import SamplingParams
from test_engine import assert_all_blocks_free, random_prompts, run_to_completion
from test_families import hand_off, needle_outputs

EOS = frozenset({2})
PROMPTS = random_prompts([1, 9, 31, 33, 70], seed=5)


def shm_files() -> set[str]:
    """This process's tensor-parallel shared files (the KV pool's and the collectives'; their
    names carry rank 0's pid, so another test run on the machine does not count)."""
    pid = os.getpid()
    return set(glob.glob(f"/dev/shm/pdserve-tp-{pid}-*") + glob.glob(f"/dev/shm/pdserve-tp-kv-{pid}-*"))


def llama(heads: int, kv_heads: int, seed: int = 3) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, head_dim=16, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0)
    return LlamaForCausalLM(config).eval()


def engine(model, tp: int, **config) -> Engine:
    return Engine(model, EngineConfig(**{"num_blocks": 128, "block_size": 4, "max_num_batched_tokens": 40, "chunk_size": 16,
                                         "tensor_parallel_size": tp, **config}), EOS, 512)


def greedy(eng: Engine, prompts, max_tokens: int = 12) -> list[list[int]]:
    seqs = [Sequence(f"r{i}", list(p), len(p), SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for i, p in enumerate(prompts)]
    for seq in seqs:
        eng.add(seq)
    run_to_completion(eng)
    assert_all_blocks_free(eng)
    return [seq.token_ids[len(p):] for seq, p in zip(seqs, prompts)]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral_window", "phi3", "gemma2", "gemma3", "mixtral", "qwen3_moe"])
def test_every_family_that_splits_equals_hf_generate_at_tp2(family):
    """Batched and chunked, on the fused C decoder (llama, qwen2, phi3) or per layer; the MoE
    families with each expert's intermediate size split (Qwen3-MoE: an MoE layer, then a dense one)."""
    before = shm_files()
    eng = engine(tiny_model(family, seed=3), 2)
    try:
        got = greedy(eng, PROMPTS)
    finally:
        eng.close()
    reference = tiny_model(family, seed=3)
    assert got == [reference_generate(reference, p, 12, ignore_eos=True) for p in PROMPTS]
    assert shm_files() == before


@pytest.mark.parametrize("heads,kv_heads,tp", [(8, 4, 2), (8, 8, 2), (4, 1, 2), (8, 2, 4)])
def test_split_and_replicated_kv_heads_equal_hf_generate(heads, kv_heads, tp):
    """4 and 8 KV heads split over 2 ranks; 1 KV head over 2 ranks and 2 over 4 replicated."""
    model = llama(heads, kv_heads)
    eng = engine(model, tp)
    try:
        got = greedy(eng, PROMPTS[1:4], 8)
    finally:
        eng.close()
    assert got == [reference_generate(model, p, 8, ignore_eos=True) for p in PROMPTS[1:4]]


@pytest.mark.parametrize("family,dtype", [("llama", torch.float32), ("llama", torch.bfloat16), ("mixtral", torch.bfloat16)])
def test_a_needle_at_tp2_is_the_same_bits_alone_and_anywhere_in_a_batch(family, dtype):
    needle = random_prompts([37], seed=11)[0]
    model = llama(8, 4) if family == "llama" else tiny_model(family, seed=3)
    eng = engine(model.to(dtype), 2, max_num_batched_tokens=256, chunk_size=64)
    try:
        alone = needle_outputs(eng, [needle], 0)
        rng = random.Random(7)
        for batch in (3, 16):
            others = random_prompts([rng.randint(1, 60) for _ in range(batch - 1)], seed=batch)
            where = rng.randrange(batch)
            assert needle_outputs(eng, [*others[:where], needle, *others[where:]], where) == alone
    finally:
        eng.close()


@pytest.mark.parametrize("p_tp,d_tp", [(2, 1), (1, 2)])
def test_kv_handed_off_between_tp_sizes_decodes_to_hf_ids(p_tp, d_tp):
    """The pool holds whole KV heads at every TP size, so the hand-off's bytes are the same."""
    model = llama(8, 4)
    prefill, decode = engine(model, p_tp), engine(model, d_tp)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    try:
        for i, p in enumerate(PROMPTS):
            assert hand_off(prefill, decode, p, params, str(i)) == reference_generate(model, p, 10, ignore_eos=True)
        assert_all_blocks_free(prefill)
        assert_all_blocks_free(decode)
    finally:
        prefill.close()
        decode.close()


def test_the_bundled_model_at_tp3_equals_hf_generate(real_model_dir):
    """SmolLM2-135M: 9 heads and 3 KV heads, one KV head per rank (three ranks on this machine's cores)."""
    from transformers import AutoModelForCausalLM

    from pdserve.model_loader import load_checkpoint

    prompts = [random_prompts([n], seed=n)[0] for n in (5, 40)]
    prompts = [[t + 100 for t in p] for p in prompts]
    eng = Engine(load_checkpoint(real_model_dir, "float32"), EngineConfig(num_blocks=64, block_size=16, tensor_parallel_size=3), EOS, 512)
    try:
        got = greedy(eng, prompts, 8)
    finally:
        eng.close()
    reference = AutoModelForCausalLM.from_pretrained(real_model_dir, dtype=torch.float32).eval()
    assert got == [reference_generate(reference, p, 8, ignore_eos=True) for p in prompts]


@pytest.mark.parametrize("heads,kv_heads,tp,message", [
    (6, 2, 4, "tensor_parallel_size 4 does not divide the model's 6 attention heads"),
    (8, 3, 2, "the model's 3 KV heads neither divide among nor replicate over 2 ranks"),
])
def test_a_model_that_does_not_split_is_refused_in_one_line(heads, kv_heads, tp, message):
    config = LlamaConfig(hidden_size=48 if heads == 6 else 64, intermediate_size=128, num_attention_heads=heads, num_key_value_heads=kv_heads)
    with pytest.raises(UnsupportedModelError, match=message):
        check_tensor_parallel(config, "LlamaForCausalLM", tp)
    before = shm_files()
    with pytest.raises(UnsupportedModelError, match="not DeepseekV2ForCausalLM"):
        engine(tiny_model("deepseek_v2_lite"), 2)
    assert shm_files() == before


def test_experts_whose_intermediate_size_does_not_divide_are_refused_in_one_line():
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=50, num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(UnsupportedModelError, match="tensor_parallel_size 4 does not divide the model's expert intermediate size 50"):
        check_tensor_parallel(config, "Qwen3MoeForCausalLM", 4)
    check_tensor_parallel(config, "Qwen3MoeForCausalLM", 2)


def test_a_killed_rank_fails_the_step_and_the_health_check_by_name():
    before = shm_files()
    eng = engine(llama(8, 4), 2)
    try:
        assert greedy(eng, PROMPTS[:1], 2)
        eng.check_health()
        os.kill(eng.tp.ranks[0].pid, signal.SIGKILL)
        eng.tp.ranks[0].wait(10)
        with pytest.raises(RuntimeError, match="tensor parallel rank 1 .* died"):
            eng.check_health()
        seq = Sequence("after", list(PROMPTS[2]), len(PROMPTS[2]), SamplingParams(max_tokens=2))
        eng.add(seq)
        with pytest.raises(RuntimeError, match="tensor parallel rank 1"):
            eng.step()
    finally:
        eng.close()
    assert shm_files() == before


def test_a_rank_that_dies_mid_collective_aborts_rank_0s_wait_at_once():
    """Rank 0 waits in an all-reduce that rank 1 (idle, between steps) never joins; killing
    rank 1 ends the wait with "aborted" (not the timeout's TimeoutError, 120 s later), and
    every later collective fails the same way."""
    import threading

    eng = engine(llama(8, 4), 2)
    comm = eng.model.embed.comm
    failed: list[BaseException] = []

    def wait_in_collective():
        try:
            comm.all_reduce_(torch.zeros(8))
        except BaseException as e:  # noqa: BLE001 - the test reads it
            failed.append(e)

    try:
        waiter = threading.Thread(target=wait_in_collective)
        waiter.start()
        os.kill(eng.tp.ranks[0].pid, signal.SIGKILL)
        waiter.join(60)  # a DEADLINE against a hang: the abort ends it at once, a timeout would take 120 s
        assert not waiter.is_alive()
        assert len(failed) == 1 and isinstance(failed[0], RuntimeError) and "aborted (a peer rank died)" in str(failed[0])
        with pytest.raises(RuntimeError, match="aborted"):
            comm.barrier()
    finally:
        eng.close()


VOCAB = 49152  # the bundled tokenizer's


@pytest.fixture(scope="module")
def tp_checkpoint(tmp_path_factory, real_model_dir):
    """A tiny Llama of 8 heads and 4 KV heads with the bundled tokenizer, and HF's greedy ids."""
    import shutil

    path = tmp_path_factory.mktemp("tp_llama")
    torch.manual_seed(3)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                                         num_key_value_heads=4, head_dim=16, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                                         pad_token_id=0)).eval()
    model.save_pretrained(path)
    for name in real_model_dir.glob("*"):
        if name.name.startswith(("tokenizer", "special_tokens")) or name.suffix == ".jinja":
            shutil.copy(name, path / name.name)
    prompts = [[1, *range(100, 100 + n)] for n in (5, 40)]
    return path, prompts, [reference_generate(model, p, 8, ignore_eos=True) for p in prompts]


def worker_config(path, backend: str, p_tp: int, d_tp: int) -> dict:
    pool = {"kv_cache_tokens": 512, "block_size": 4, "num_threads": 1}
    return {"model": {"path": str(path), "dtype": "float32", "max_model_len": 256},
            "prefill": {**pool, "kv_lease_s": 30, "tensor_parallel_size": p_tp}, "decode": {**pool, "tensor_parallel_size": d_tp},
            "colocated": {**pool, "tensor_parallel_size": d_tp}, "kv_transfer": {"backend": backend, "bind_host": "127.0.0.1", "timeout_s": 2.0}}


@pytest.mark.parametrize("backend,p_tp,d_tp", [("grpc", 2, 1), ("shm", 2, 1), ("shm", 1, 2)])
def test_workers_of_different_tp_sizes_hand_off_over_each_transport(tp_checkpoint, backend, p_tp, d_tp):
    """The prefill and decode worker classes (no Ray Serve) at their own TP sizes: greedy ids
    equal HF; blocks, leases and the ranks' shared files back at baseline afterwards."""
    import asyncio

    from decode_worker.server import DecodeServer
    from pdserve.messages import PrefillRequest, WithKV
    from prefill_worker.server import PrefillServer
    from test_workers import settle

    path, prompts, want = tp_checkpoint
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    before = shm_files()
    prefill, decode = PrefillServer(worker_config(path, backend, p_tp, d_tp)), DecodeServer(worker_config(path, backend, p_tp, d_tp))

    async def run(prompt: list[int], request_id: str) -> list[int]:
        first = await prefill.prefill(PrefillRequest(request_id, prompt, params))
        tokens = [first.first_token]
        async for chunk in decode.generate(WithKV(request_id, prompt, params, first.first_token, first.kv)):
            tokens.extend(chunk.token_ids)
        return tokens

    try:
        assert [asyncio.run(run(p, f"r{i}")) for i, p in enumerate(prompts)] == want
        p, d = asyncio.run(settle(prefill, decode))
        assert p["num_held"] == 0 and p["num_free_blocks"] == p["num_blocks"] and d["num_free_blocks"] == d["num_blocks"]
        assert d[f"kv_num_fetched_{backend}"] == len(prompts)
        prefill.check_health()
        decode.check_health()
    finally:
        for server in (prefill, decode):
            server.loop.close(wait_s=30)
            server.__del__()
    assert shm_files() == before


def test_a_colocated_worker_at_tp2_equals_hf_generate(tp_checkpoint):
    import asyncio

    from decode_worker.server import DecodeServer
    from pdserve.messages import FreshRequest

    path, prompts, want = tp_checkpoint
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    server = DecodeServer({**worker_config(path, "grpc", 1, 2), "mode": "colocated"}, pool="colocated")

    async def run(prompt: list[int], request_id: str) -> list[int]:
        return [t async for chunk in server.generate(FreshRequest(request_id, prompt, params)) for t in chunk.token_ids]

    try:
        assert [asyncio.run(run(p, f"c{i}")) for i, p in enumerate(prompts)] == want
        stats = asyncio.run(server.stats())
        assert stats["num_free_blocks"] == stats["num_blocks"]
    finally:
        server.loop.close(wait_s=30)
        server.__del__()
