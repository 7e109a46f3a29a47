"""mode: colocated on a real Ray Serve cluster (real model, float32): one pool runs prefill
and decode with the same engine, prefill chunks mixed into decode steps. The baseline
that disaggregation is compared against must give the same greedy answers."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from conftest import reference_generate, serve_cluster
from test_e2e import text_prompt

pytestmark = pytest.mark.e2e
GRPC_PORT, HTTP_PORT = 9130, 8130


@pytest.fixture(scope="module")
def cluster():
    yield from serve_cluster({
        "mode": "colocated", "model": {"dtype": "float32"}, "router": {"grpc_port": GRPC_PORT, "http_port": HTTP_PORT},
        "colocated": {"chunk_size": 64, "max_num_batched_tokens": 96, "kv_cache_tokens": 16384},  # long prompts go in chunks beside decodes
    })


@pytest.fixture(scope="module")
def reference(real_model_dir):
    from pdserve.model_loader import load_model, load_tokenizer

    torch.set_num_threads(1)
    return load_model(real_model_dir, "float32"), load_tokenizer(real_model_dir)


def test_only_router_and_colocated_pool_run(cluster):
    from ray import serve

    status = serve.status().applications["pdserve"].deployments
    assert set(status) == {"router", "colocated"}


def test_concurrent_mixed_lengths_equal_reference(cluster, reference):
    model, tokenizer = reference
    prompts = [text_prompt(tokenizer, n) for n in (5, 70, 200, 33, 130, 12)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: cluster.generate(prompt_token_ids=p, max_tokens=12, ignore_eos=True), prompts))
    for prompt, result in zip(prompts, results):
        assert result.token_ids == reference_generate(model, prompt, 12, ignore_eos=True)


def test_openai_chat_and_stop_strings_work_colocated(cluster):
    import openai

    oai = openai.OpenAI(base_url=f"http://127.0.0.1:{HTTP_PORT}/v1", api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = oai.chat.completions.create(model="smollm2", messages=messages, max_tokens=24, temperature=0).choices[0].message.content
    assert "Paris" in text
    cut = oai.chat.completions.create(model="smollm2", messages=messages, max_tokens=24, temperature=0, stop=["Paris"])
    assert cut.choices[0].message.content == text[: text.index("Paris")]


def test_n_choices_prefill_once_and_each_equals_its_seed_alone_colocated(cluster, reference):
    import openai

    from test_e2e import check_n_choices

    oai = openai.OpenAI(base_url=f"http://127.0.0.1:{HTTP_PORT}/v1", api_key="unused", max_retries=0, timeout=120)
    check_n_choices(cluster, oai, text_prompt(reference[1], 45))


def test_colocated_pool_is_back_at_baseline(cluster):
    import time

    from ray import serve

    handle = serve.get_deployment_handle("colocated", app_name="pdserve")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stats = handle.stats.remote().result()
        if stats["num_running"] == 0 and stats["num_used_blocks"] == 0:
            break
        time.sleep(0.5)
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["num_used_blocks"] == 0
    assert stats["num_kv_fetched"] == 0  # no KV ever moved


def test_bench_serve_load_generator_against_the_cluster(cluster, tmp_path):
    """`pdserve bench serve` (bench/serve.py) on a small trace: every request measured."""
    import argparse
    import json

    from bench import serve as bench_serve

    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"prompt_tokens": 10 + 7 * i, "output_tokens": 4 + i % 3}) + "\n" for i in range(6)))
    parser = argparse.ArgumentParser()
    bench_serve.add_arguments(parser)
    args = parser.parse_args(["--base-url", f"http://127.0.0.1:{HTTP_PORT}/v1", "--dataset", str(trace), "--num-requests", "6",
                              "--warmup", "1", "--rate", "4", "--ttft-slo", "60", "--tpot-slo", "10", "--out", str(tmp_path / "out")])
    summary = bench_serve.main(args)
    assert summary["num_ok"] == 6 and summary["num_failed"] == 0 and summary["slo_attainment"] == 1.0
    saved = json.loads((tmp_path / "out" / "serve.json").read_text())
    assert [r["output_tokens"] for r in saved["requests"]] == [4 + i % 3 for i in range(1, 7)]  # trace cycled after the warm-up
    assert all(r["ttft_s"] > 0 and r["e2e_s"] >= r["ttft_s"] for r in saved["requests"])
    assert (tmp_path / "out" / "serve.png").stat().st_size > 0


def test_bench_goodput_sweeps_rates_and_finds_the_limit(cluster, tmp_path):
    import json

    from bench import goodput

    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"prompt_tokens": 12, "output_tokens": 3}) + "\n" for _ in range(3)))
    common = ["--base-url", f"http://127.0.0.1:{HTTP_PORT}/v1", "--dataset", str(trace), "--num-requests", "4",
              "--start-rate", "1", "--factor", "4", "--max-rate", "4", "--bisect", "0", "--out", str(tmp_path)]
    loose = goodput.main([*common, "--label", "loose", "--ttft-slo", "120", "--tpot-slo", "60"])
    assert loose["goodput_rps"] == 4 and [p["rate"] for p in loose["points"]] == [1, 4]  # met at every rate tried
    strict = goodput.main([*common, "--label", "strict", "--ttft-slo", "0.0001", "--compare", str(tmp_path / "goodput-loose.json")])
    assert strict["goodput_rps"] is None and strict["points"][0]["slo_attainment"] == 0  # no rate meets a 0.1 ms TTFT
    assert (tmp_path / "goodput.png").stat().st_size > 0


def test_a_constrained_request_equals_the_reference_colocated(cluster, reference):
    """The JSON schema of test_e2e's disaggregated check, on the one pool: the same ids as HF
    generate under the same mask (so the same as disaggregated)."""
    import json

    from pdserve.structured import StructuredOutput
    from test_e2e import PERSON, grammar_reference

    model, tokenizer = reference
    messages = [{"role": "user", "content": "Describe a person as JSON."}]
    prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
    want = grammar_reference(model, tokenizer, prompt, StructuredOutput("json", json.dumps(PERSON)), 40)
    got = cluster.generate(messages=messages, max_tokens=40, json_schema=PERSON)
    assert got.token_ids == want and got.finish_reason == "stop"
