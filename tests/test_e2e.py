"""End to end on a real Ray Serve cluster with the real model (SmolLM2-135M-Instruct, float32).

Greedy token ids from router -> prefill pool -> KV over gRPC -> decode pool must
equal single-process ``model.generate`` exactly.
"""

from __future__ import annotations

import os

import grpc
import pytest
import torch

from conftest import reference_generate
from pdserve.client import Client

pytestmark = pytest.mark.e2e

GRPC_PORT, HTTP_PORT = 9110, 8110
TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a screw press adapted from wine making. "
    "Within fifty years, presses were running in more than two hundred European cities, and the "
    "price of books fell so quickly that reading spread from monasteries and universities to "
    "merchants, artisans and eventually ordinary households. Scholars argue about how much the "
    "press caused the Reformation, the scientific revolution and the rise of national languages, "
    "but few doubt that cheap, identical copies changed how ideas travelled. "
)


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray import serve

    from pdserve.config import ClusterConfig
    from pdserve.deploy import deploy

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    cfg = ClusterConfig.from_dict(
        {"model": {"dtype": "float32"}, "router": {"grpc_port": GRPC_PORT, "http_port": HTTP_PORT}}
    )
    deploy(cfg)
    client = Client(f"127.0.0.1:{GRPC_PORT}")
    client.health(timeout_s=30)
    yield client
    client.close()
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def reference(real_model_dir):
    from pdserve.model_loader import load_model, load_tokenizer

    torch.set_num_threads(1)  # as the workers (num_cpus: 1)
    return load_model(real_model_dir, "float32"), load_tokenizer(real_model_dir)


def pool_stats(name: str) -> dict:
    from ray import serve

    return serve.get_deployment_handle(name, app_name="pdserve").stats.remote().result()


def text_prompt(tokenizer, num_tokens: int) -> list[int]:
    ids = tokenizer(TEXT * 6).input_ids
    assert len(ids) >= num_tokens
    return ids[:num_tokens]


def strip_eos(ids: list[int], eos: int) -> tuple[list[int], str]:
    """Reference ids as the server reports them: the stop token is not part of the output."""
    if eos in ids:
        return ids[: ids.index(eos)], "stop"
    return ids, "length"


@pytest.mark.parametrize("num_tokens", [1, 15, 16, 17, 64, 500])
def test_greedy_equals_reference(cluster, reference, num_tokens):
    model, tokenizer = reference
    prompt = text_prompt(tokenizer, num_tokens)
    want, want_finish = strip_eos(reference_generate(model, prompt, 32), tokenizer.eos_token_id)
    got = cluster.generate(prompt_token_ids=prompt, max_tokens=32)
    assert got.token_ids == want
    assert got.finish_reason == want_finish
    assert (got.prompt_tokens, got.completion_tokens) == (num_tokens, len(want))
    assert got.text == tokenizer.decode(want, skip_special_tokens=True)


def test_chat_answer_equals_reference_and_names_paris(cluster, reference):
    model, tokenizer = reference
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])
    want, _ = strip_eos(reference_generate(model, prompt, 32), tokenizer.eos_token_id)
    got = cluster.generate(messages=messages, max_tokens=32)
    assert got.prompt_tokens == len(prompt)
    assert got.token_ids == want
    assert "Paris" in got.text


def test_max_tokens_1_runs_no_decode_step(cluster, reference):
    model, tokenizer = reference
    prompt = text_prompt(tokenizer, 20)
    first = reference_generate(model, prompt, 1)
    before = pool_stats("decode")
    got = cluster.generate(prompt_token_ids=prompt, max_tokens=1)
    assert got.token_ids == first and got.finish_reason == "length"
    after = pool_stats("decode")
    assert after["num_steps"] == before["num_steps"] and after["num_kv_fetched"] == before["num_kv_fetched"]


def test_first_token_stop_gives_empty_output_and_no_decode_step(cluster, reference):
    model, tokenizer = reference
    prompt = text_prompt(tokenizer, 33)
    first = reference_generate(model, prompt, 1)[0]
    before = pool_stats("decode")
    got = cluster.generate(prompt_token_ids=prompt, max_tokens=16, stop_token_ids=[first])
    assert got.token_ids == [] and got.text == "" and got.finish_reason == "stop"
    assert pool_stats("decode")["num_steps"] == before["num_steps"]


@pytest.mark.parametrize(
    "request_kwargs, message",
    [
        ({"prompt": "", "max_tokens": 8}, "prompt is empty"),
        ({"prompt_token_ids": [42] * 8000, "max_tokens": 500}, "exceeds the model's context of 8192"),
        ({"prompt": "Hello", "max_tokens": 0}, "max_tokens must be >= 1"),
        ({"prompt": "Hello", "max_tokens": 8, "temperature": -1.0}, "temperature must be >= 0"),
        ({"prompt_token_ids": [49152], "max_tokens": 8}, "outside the vocabulary"),
    ],
)
def test_bad_input_is_invalid_argument_and_cluster_keeps_serving(cluster, reference, request_kwargs, message):
    model, tokenizer = reference
    with pytest.raises(grpc.RpcError) as info:
        list(cluster.stream(**request_kwargs))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in info.value.details()
    prompt = text_prompt(tokenizer, 10)
    want, _ = strip_eos(reference_generate(model, prompt, 4), tokenizer.eos_token_id)
    assert cluster.generate(prompt_token_ids=prompt, max_tokens=4).token_ids == want


def test_unknown_model_is_invalid_argument(cluster):
    from pdserve.rpc import generate_pb2 as pb
    from pdserve.rpc import generate_pb2_grpc as pb_grpc

    stub = pb_grpc.GeneratorStub(grpc.insecure_channel(f"127.0.0.1:{GRPC_PORT}"))
    request = pb.GenerateRequest(prompt="Hi", model="gpt-9", params=pb.SamplingParams(max_tokens=2))
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(request, timeout=60))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "unknown model 'gpt-9'" in info.value.details()


def test_health(cluster):
    health = cluster.health()
    assert health.ok and health.model == "smollm2" and health.max_model_len == 8192


def test_nothing_is_left_held_or_running(cluster):
    prefill, decode = pool_stats("prefill"), pool_stats("decode")
    assert prefill["num_held"] == 0 and prefill["bytes_held"] == 0
    assert prefill["num_expired"] == 0  # every lease was acknowledged, none timed out
    assert decode["num_running"] == 0 and decode["num_waiting"] == 0
