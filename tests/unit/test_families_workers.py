"""Each model family through the worker classes (no Ray Serve), float32: a tiny random
checkpoint written to disk with the bundled tokenizer, loaded by each worker from its
safetensors (model_loader.load_checkpoint), the prompt's KV handed from the prefill worker to
the decode worker over grpc and shm, and served colocated. Greedy ids equal HF
``model.generate``; every block and lease is back at baseline afterwards."""

import asyncio
import shutil

import pytest

from conftest import NO_COMPILER, reference_generate, tiny_model
from decode_worker.server import DecodeServer
from pdserve.engine import cpu
from pdserve.messages import FreshRequest, PrefillRequest, WithKV
from pdserve.sampling import SamplingParams
from prefill_worker.server import PrefillServer
from test_workers import settle

FAMILIES = ["qwen3", "mistral_window", "phi3", "mixtral", "qwen3_moe", "gemma2", "gemma3", "deepseek_v2", "llama3_rope"]
BACKENDS = ["grpc", pytest.param("shm", marks=pytest.mark.skipif(cpu.compiler() is None, reason=NO_COMPILER))]
VOCAB = 49152  # the bundled tokenizer's
PROMPTS = [[1, *range(100, 100 + n)] for n in (5, 40)]  # a window of 8 tokens is shorter than the second
PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, real_model_dir):
    """family -> (its directory, HF's greedy ids per prompt)."""
    out = {}
    for family in FAMILIES:
        path = tmp_path_factory.mktemp(family)
        model = tiny_model(family, seed=3, vocab_size=VOCAB)
        model.save_pretrained(path)
        for name in real_model_dir.glob("*"):  # the tokenizer's files
            if name.name.startswith(("tokenizer", "special_tokens")) or name.suffix == ".jinja":
                shutil.copy(name, path / name.name)
        out[family] = path, [reference_generate(model, p, PARAMS.max_tokens, ignore_eos=True) for p in PROMPTS]
    return out


def config(path, backend: str) -> dict:
    pool = {"kv_cache_tokens": 512, "block_size": 4}
    return {"model": {"path": str(path), "dtype": "float32", "max_model_len": 256}, "prefill": {**pool, "kv_lease_s": 30}, "decode": pool,
            "colocated": pool, "kv_transfer": {"backend": backend, "bind_host": "127.0.0.1", "timeout_s": 2.0}}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_hands_off_between_workers_and_equals_hf_generate(family, backend, checkpoints):
    path, want = checkpoints[family]
    prefill, decode = PrefillServer(config(path, backend)), DecodeServer(config(path, backend))

    async def run(prompt: list[int], request_id: str) -> list[int]:
        first = await prefill.prefill(PrefillRequest(request_id, prompt, PARAMS))
        tokens = [first.first_token]
        async for chunk in decode.generate(WithKV(request_id, prompt, PARAMS, first.first_token, first.kv)):
            tokens.extend(chunk.token_ids)
        return tokens

    try:
        assert [asyncio.run(run(p, f"r{i}")) for i, p in enumerate(PROMPTS)] == want
        p, d = asyncio.run(settle(prefill, decode))
        assert p["num_held"] == 0 and p["num_free_blocks"] == p["num_blocks"] and d["num_free_blocks"] == d["num_blocks"]
        assert d[f"kv_num_fetched_{backend}"] == len(PROMPTS)
    finally:
        prefill.__del__()
        decode.__del__()


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_colocated_equals_hf_generate(family, checkpoints):
    path, want = checkpoints[family]
    server = DecodeServer({**config(path, "grpc"), "mode": "colocated"}, pool="colocated")

    async def run(prompt: list[int], request_id: str) -> list[int]:
        return [t async for chunk in server.generate(FreshRequest(request_id, prompt, PARAMS)) for t in chunk.token_ids]

    try:
        assert [asyncio.run(run(p, f"c{i}")) for i, p in enumerate(PROMPTS)] == want
        stats = asyncio.run(server.stats())
        assert stats["num_free_blocks"] == stats["num_blocks"]
    finally:
        server.__del__()
