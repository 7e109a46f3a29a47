"""The families whose KV or tables differ most from Llama's, on a real Ray Serve cluster (1
prefill + 1 decode replica, float32), from a tiny random checkpoint written with the bundled
tokenizer: DeepSeek-V2's latent KV over gRPC, Phi-3's longrope over shm (the 31-token prompt
crosses its switch at 32 while decoding, so the decode replica recomputes it on the long
table), Mistral's window of 8 over gRPC (decode gives passed blocks back). Greedy ids equal
HF ``model.generate``."""

from __future__ import annotations

import shutil

import pytest

from conftest import reference_generate, serve_cluster, tiny_model

pytestmark = pytest.mark.e2e

GRPC_PORT, HTTP_PORT = 9210, 8210
PROMPTS = [[1, *range(100, 100 + n)] for n in (5, 31, 40)]


@pytest.mark.parametrize("family, transfer", [("deepseek_v2", "grpc"), ("phi3_longrope", "shm"), ("mistral_window", "grpc")])
def test_a_family_served_disaggregated_equals_hf_generate(family, transfer, tmp_path, real_model_dir):
    model = tiny_model(family, seed=3, vocab_size=49152)  # the bundled tokenizer's vocabulary
    model.save_pretrained(tmp_path)
    for name in real_model_dir.glob("*"):
        if name.name.startswith(("tokenizer", "special_tokens")) or name.suffix == ".jinja":
            shutil.copy(name, tmp_path / name.name)
    want = [reference_generate(model, p, 24, ignore_eos=True) for p in PROMPTS]
    pool = {"kv_cache_tokens": 1024, "block_size": 4}
    config = {"model": {"path": str(tmp_path), "dtype": "float32", "max_model_len": 256}, "prefill": pool, "decode": pool,
              "kv_transfer": {"backend": transfer}, "router": {"grpc_port": GRPC_PORT, "http_port": HTTP_PORT}}
    cluster = serve_cluster(config)
    client = next(cluster)
    try:
        assert [client.generate(prompt_token_ids=p, max_tokens=24, ignore_eos=True).token_ids for p in PROMPTS] == want
    finally:
        next(cluster, None)  # shuts it down
