"""End to end on a real Ray Serve cluster with the real model (SmolLM2-135M-Instruct, float32).

Greedy token ids from router -> prefill pool -> KV over gRPC -> decode pool must
equal single-process ``model.generate`` exactly.
"""

from __future__ import annotations


import grpc
import pytest
import torch

from conftest import reference_generate, serve_cluster

pytestmark = pytest.mark.e2e

GRPC_PORT, HTTP_PORT, METRICS_PORT = 9110, 8110, 8181
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
    pool = {"kv_cache_tokens": 16384}  # half the default: less pool to map at start, still room for every test here
    config = {"model": {"dtype": "float32"}, "router": {"grpc_port": GRPC_PORT, "http_port": HTTP_PORT}, "prefill": pool, "decode": pool}
    yield from serve_cluster(config, _metrics_export_port=METRICS_PORT)


@pytest.fixture(scope="module")
def reference(real_model_dir):
    from pdserve.model_loader import load_model, load_tokenizer

    torch.set_num_threads(1)  # as the workers (num_cpus: 1); the references take every core (conftest.all_cores)
    return load_model(real_model_dir, "float32"), load_tokenizer(real_model_dir)


def pool_stats(name: str) -> dict:
    from ray import serve

    return serve.get_deployment_handle(name, app_name="pdserve").stats.remote().result()


def wait_until_idle(timeout_s: float, prefill_too: bool = False) -> tuple[dict, dict]:
    """(prefill, decode) stats once no lease is held and decode runs and holds nothing, or at
    the deadline. ``prefill_too``: prefill must run and hold nothing either (a layer-wise
    lease can end while its prompt still computes)."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        prefill, decode = pool_stats("prefill"), pool_stats("decode")
        pools = (prefill, decode) if prefill_too else (decode,)
        idle = prefill["num_held"] == 0 and all(s["num_running"] == 0 and s["num_waiting"] == 0 and s["num_used_blocks"] == 0 for s in pools)
        if idle or time.monotonic() > deadline:
            return prefill, decode
        time.sleep(0.25)


def leave_streams(cluster, prompt_ids: list[int], max_tokens: int, delays: tuple[float, ...]) -> None:
    """One stream per delay, cancelled by its client that many seconds after it started."""
    import threading
    import time

    for delay in delays:
        call = cluster.stream(prompt_token_ids=prompt_ids, max_tokens=max_tokens)
        reader = threading.Thread(target=lambda: list(call))
        reader.start()
        time.sleep(delay)
        call.cancel()
        reader.join(30)
        assert not reader.is_alive()


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
    prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
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
        ({"prompt": "Hello", "max_tokens": 8, "temperature": -1.0}, "temperature must be a finite number >= 0"),
        ({"prompt_token_ids": [49152], "max_tokens": 8}, "outside the vocabulary"),
        ({"prompt_token_ids": [-3, 5], "max_tokens": 8}, "outside the vocabulary"),
        ({"prompt": "Hello", "max_tokens": -5}, "max_tokens must be >= 1"),
        ({"prompt": "Hello", "max_tokens": 8, "top_p": 0.0}, "top_p must be in (0, 1]"),
        ({"prompt": "Hello", "max_tokens": 8, "seed": -1}, "seed must be in [0, 2**63 - n]"),
        ({"prompt": "Hello", "max_tokens": 8, "stop_token_ids": [10**9]}, "stop_token_ids has 1000000000"),
        ({"messages": [{"role": "wizard", "content": "hi"}], "max_tokens": 8}, "message role 'wizard'"),
        ({"messages": [{"role": "user", "content": " "}], "max_tokens": 8}, "every message has empty content"),
        ({"prompt": "Hello", "messages": [{"role": "user", "content": "hi"}]}, "set only one of"),
        ({"prompt": "Hello", "max_tokens": 8, "json_schema": '{"type": "objec"}'}, "the json constraint does not compile: Invalid type: objec"),
        ({"prompt": "Hello", "max_tokens": 8, "regex": "(("}, "the regex constraint does not compile"),
        ({"prompt": "Hello", "max_tokens": 8, "choice": []}, "choice needs at least one choice"),
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


def test_tiny_temperature_is_greedy(cluster, reference):
    model, tokenizer = reference
    prompt = text_prompt(tokenizer, 12)
    want, _ = strip_eos(reference_generate(model, prompt, 6), tokenizer.eos_token_id)
    assert cluster.generate(prompt_token_ids=prompt, max_tokens=6, temperature=1e-40).token_ids == want


def test_32_concurrent_requests_of_mixed_lengths_equal_reference(cluster, reference):
    """They share prefill and decode forwards (batched, ragged) and must not change a token.
    With the default conditional disaggregation, some of them queue at the prefill pool long
    enough to be prefilled by decode itself: those equal the reference too."""
    from concurrent.futures import ThreadPoolExecutor

    model, tokenizer = reference
    ids = tokenizer(TEXT * 6).input_ids
    prompts = [ids[i * 7 : i * 7 + 3 + (i * 37) % 300] for i in range(32)]
    wants = [strip_eos(reference_generate(model, p, 16), tokenizer.eos_token_id)[0] for p in prompts]
    cluster.generate(prompt_token_ids=ids[:200], max_tokens=1)  # alone: the router measures prefill's rate
    before = pool_stats("router")
    with ThreadPoolExecutor(32) as pool:
        gots = list(pool.map(lambda p: cluster.generate(prompt_token_ids=p, max_tokens=16, request_id="same-id"), prompts))
    assert [g.token_ids for g in gots] == wants
    assert all(g.request_id == "same-id" for g in gots)  # echoed; internal ids stay unique
    after = pool_stats("router")
    local, remote = (after[k] - before[k] for k in ("num_prefill_local_queued", "num_prefill_remote"))
    assert local >= 1 and remote >= 1 and local + remote + after["num_prefill_local_short"] - before["num_prefill_local_short"] == 32
    stats = pool_stats("decode")
    assert stats["num_running"] == 0 and stats["num_used_blocks"] == 0


def test_unknown_model_and_unparsable_bytes_are_invalid_argument(cluster):
    from pdserve.rpc import generate_pb2 as pb
    from pdserve.rpc import generate_pb2_grpc as pb_grpc

    stub = pb_grpc.GeneratorStub(grpc.insecure_channel(f"127.0.0.1:{GRPC_PORT}"))
    request = pb.GenerateRequest(prompt="Hi", model="gpt-9", params=pb.SamplingParams(max_tokens=2))
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(request, timeout=60))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "unknown model 'gpt-9'" in info.value.details()
    channel = grpc.insecure_channel(f"127.0.0.1:{GRPC_PORT}")
    raw = channel.unary_stream("/pdserve.rpc.Generator/Generate", request_serializer=bytes, response_deserializer=bytes)
    with pytest.raises(grpc.RpcError) as info:  # field 1 (prompt), a string, holding invalid UTF-8
        list(raw(b"\x0a\x02\xff\xfe", timeout=60))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
    assert "not a valid pdserve.rpc.GenerateRequest" in info.value.details()


def test_health(cluster):
    health = cluster.health()
    assert health.ok and health.model == "smollm2" and health.max_model_len == 8192


def test_the_kv_channel_refuses_a_caller_without_this_deployments_secret(cluster):
    """security.kv_secret unset (the default): the deployment made a secret of its own. A
    caller without it is refused on all four KV RPCs; on one node the KV server is on loopback."""
    from ray import serve

    from pdserve.rpc import kv_pb2, kv_pb2_grpc

    address = serve.get_deployment_handle("prefill", "pdserve").stats.remote().result(timeout_s=30)["kv_address"]
    assert address.startswith("127.0.0.1:")
    with grpc.insecure_channel(address) as channel:
        stub = kv_pb2_grpc.KVTransferStub(channel)
        calls = [(stub.Handshake, kv_pb2.HandshakeRequest()), (stub.DescribeKV, kv_pb2.DescribeKVRequest(transfer_id="x")),
                 (stub.ReleaseKV, kv_pb2.ReleaseKVRequest(transfer_id="x")), (stub.FetchKV, kv_pb2.FetchKVRequest(transfer_id="x"))]
        for call, request in calls:
            with pytest.raises(grpc.RpcError) as info:
                reply = call(request, timeout=10)
                if call is stub.FetchKV:
                    next(iter(reply))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, (call, info.value)


def test_cancelled_streams_release_everything(cluster, reference):
    """Clients that leave mid-stream, during prefill, at the hand-off and during the KV
    fetch: leases, queues and blocks go back to baseline (waited for, with a deadline)."""
    _, tokenizer = reference
    for i in range(4):
        call = cluster.stream(prompt_token_ids=text_prompt(tokenizer, 40 + i), max_tokens=64)
        for n, _ in enumerate(call):
            if n == 2:
                break
        call.cancel()
    # leaving during prefill, at the hand-off and during the KV fetch
    leave_streams(cluster, text_prompt(tokenizer, 200), 64, (0.0, 0.05, 0.1, 0.2, 0.3, 0.5))
    prefill, decode = wait_until_idle(60)
    assert prefill["num_held"] == 0 and prefill["num_used_blocks"] == 0
    assert decode["num_running"] == 0 and decode["num_waiting"] == 0 and decode["num_used_blocks"] == 0
    model, _ = reference
    prompt = text_prompt(tokenizer, 12)
    want, _ = strip_eos(reference_generate(model, prompt, 6), tokenizer.eos_token_id)
    assert cluster.generate(prompt_token_ids=prompt, max_tokens=6).token_ids == want


# -- sampling and stop semantics (gRPC) ------------------------------------------------

def test_stop_string_ends_the_text_before_it_streamed_or_not(cluster, reference):
    model, tokenizer = reference
    prompt = text_prompt(tokenizer, 30)
    full = tokenizer.decode(reference_generate(model, prompt, 24, ignore_eos=True), skip_special_tokens=True)
    word = full.split()[3]  # a word well inside the greedy answer
    stop = word[1:] if len(word) > 2 else word  # starts mid-token: matched on text, across token boundaries
    want = full[: full.index(stop)]
    # ids, usage and logprobs end at the token that completed the match, even inside one of
    # decode's chunks of stream_interval tokens
    ids = reference_generate(model, prompt, 24, ignore_eos=True)
    want_ids = next(ids[:k] for k in range(1, 25) if stop in tokenizer.decode(ids[:k], skip_special_tokens=True))
    result = cluster.generate(prompt_token_ids=prompt, max_tokens=24, ignore_eos=True, stop=[stop, "zzzz-never"], logprobs=1)
    assert result.text == want and result.finish_reason == "stop"
    assert result.token_ids == want_ids and result.completion_tokens == len(want_ids) and len(result.logprobs) == len(want_ids)
    chunks = list(cluster.stream(prompt_token_ids=prompt, max_tokens=24, ignore_eos=True, stop=[stop]))
    assert "".join(c.text for c in chunks) == want and not any(stop in c.text for c in chunks)
    assert [i for c in chunks for i in c.token_ids] == want_ids and chunks[-1].completion_tokens == len(want_ids)


def test_min_tokens_holds_even_when_the_first_token_would_stop(cluster, reference):
    model, tokenizer = reference
    prompt = text_prompt(tokenizer, 20)
    first = reference_generate(model, prompt, 1, ignore_eos=True)[0]
    stopped = cluster.generate(prompt_token_ids=prompt, max_tokens=8, stop_token_ids=[first])
    assert stopped.token_ids == [] and stopped.finish_reason == "stop"
    held = cluster.generate(prompt_token_ids=prompt, max_tokens=8, stop_token_ids=[first], min_tokens=3)
    assert len(held.token_ids) >= 3 and first not in held.token_ids[:3]


def test_a_character_split_across_the_prefill_decode_handoff_streams_whole(cluster, reference, oai):
    """The first token (sampled in prefill) is the first bytes of a Japanese character whose
    rest comes from decode: no chunk carries a broken character, and streamed, collected
    and decode(ids) texts are all the same."""
    _, tokenizer = reference
    messages = [{"role": "user", "content": "Write the word Tokyo in Japanese characters."}]
    chunks = list(cluster.stream(messages=messages, max_tokens=12))
    ids = [i for c in chunks for i in c.token_ids]
    assert tokenizer.decode(ids[:1]).endswith("\ufffd"), "needs a first token that is part of a character"
    assert chunks[0].token_ids and chunks[0].text == ""  # held back until decode completes it
    assert all("\ufffd" not in c.text for c in chunks)
    text = "".join(c.text for c in chunks)
    assert text == tokenizer.decode(ids, skip_special_tokens=True) == cluster.generate(messages=messages, max_tokens=12).text
    streamed = oai.chat.completions.create(model="smollm2", messages=messages, max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == text


def test_logprobs_are_the_models_and_cross_the_handoff(cluster, reference):
    model, tokenizer = reference
    prompt = text_prompt(tokenizer, 25)
    chunks = list(cluster.stream(prompt_token_ids=prompt, max_tokens=6, ignore_eos=True, logprobs=3))
    ids = [i for c in chunks for i in c.token_ids]
    lps = [lp for c in chunks for lp in c.logprobs]
    assert len(lps) == len(ids) == 6  # the first from prefill, the rest from decode
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].float()  # [6, vocab]
    want = torch.log_softmax(logits, -1)
    for pos, (token, lp) in enumerate(zip(ids, lps)):
        assert lp.token_id == token and len(lp.top) == 3
        assert lp.top[0].token_id == token and lp.top[0].logprob == pytest.approx(lp.logprob)  # greedy: the top one
        assert lp.logprob == pytest.approx(float(want[pos, token]), abs=1e-4)
        assert [t.token_id for t in lp.top] == torch.topk(want[pos], 3).indices.tolist()


def test_same_seed_same_tokens_alone_or_in_a_crowd(cluster, reference):
    from concurrent.futures import ThreadPoolExecutor

    _, tokenizer = reference
    prompt = text_prompt(tokenizer, 18)
    args = dict(prompt_token_ids=prompt, max_tokens=10, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    alone = cluster.generate(**args).token_ids
    with ThreadPoolExecutor(6) as pool:
        others = [pool.submit(cluster.generate, prompt_token_ids=text_prompt(tokenizer, 30 + i), max_tokens=12, temperature=1.0)
                  for i in range(5)]
        crowd = pool.submit(cluster.generate, **args).result().token_ids
        [f.result() for f in others]
    assert alone == crowd and len(set(alone)) > 1
    assert cluster.generate(**{**args, "seed": 99}).token_ids != alone


def test_async_client_sdk_against_the_cluster(cluster, reference):
    import asyncio

    from pdserve.client import AsyncClient

    model, tokenizer = reference
    prompts = [text_prompt(tokenizer, n) for n in (9, 21, 33)]

    async def main():
        async with AsyncClient(f"127.0.0.1:{GRPC_PORT}") as client:
            health = await client.health()
            results = await asyncio.gather(*(client.generate(prompt_token_ids=p, max_tokens=5, ignore_eos=True, timeout_s=120)
                                             for p in prompts))
            return health, results

    health, results = asyncio.run(main())
    assert health.ok
    for prompt, result in zip(prompts, results):
        assert result.token_ids == reference_generate(model, prompt, 5, ignore_eos=True) and result.finish_reason == "length"
        assert result.ttft_s > 0 and result.completion_tokens == 5


# -- OpenAI-compatible HTTP, through the real openai client --------------------------------

@pytest.fixture(scope="module")
def oai(cluster):
    import openai

    return openai.OpenAI(base_url=f"http://127.0.0.1:{HTTP_PORT}/v1", api_key="unused", max_retries=0, timeout=120)


def test_openai_models_and_health(oai):
    import urllib.request

    assert [m.id for m in oai.models.list().data] == ["smollm2"]
    with urllib.request.urlopen(f"http://127.0.0.1:{HTTP_PORT}/health", timeout=10) as r:
        assert r.status == 200


def test_openai_completion_equals_reference_streamed_or_not(oai, reference):
    model, tokenizer = reference
    prompt = text_prompt(tokenizer, 40)
    want_ids = reference_generate(model, prompt, 20, ignore_eos=True)
    want = tokenizer.decode(want_ids, skip_special_tokens=True)
    done = oai.completions.create(model="smollm2", prompt=prompt, max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    assert done.choices[0].text == want and done.choices[0].finish_reason == "length"
    assert (done.usage.prompt_tokens, done.usage.completion_tokens, done.usage.total_tokens) == (40, 20, 60)
    chunks = list(oai.completions.create(model="smollm2", prompt=prompt, max_tokens=20, temperature=0, stream=True,
                                         stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == 20 and chunks[-2].choices[0].finish_reason == "length"


def test_openai_chat_streamed_equals_non_streamed(oai, reference):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    done = oai.chat.completions.create(model="smollm2", messages=messages, max_tokens=24, temperature=0)
    text = done.choices[0].message.content
    assert "Paris" in text and done.choices[0].message.role == "assistant"
    chunks = list(oai.chat.completions.create(model="smollm2", messages=messages, max_tokens=24, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason == done.choices[0].finish_reason


def test_openai_logprobs(oai):
    done = oai.completions.create(model="smollm2", prompt="The sky is", max_tokens=5, temperature=0, logprobs=2,
                                  extra_body={"ignore_eos": True})
    lp = done.choices[0].logprobs
    assert len(lp.token_logprobs) == len(lp.tokens) == 5 and "".join(lp.tokens) == done.choices[0].text
    assert all(len(top) <= 2 and max(top.values()) == pytest.approx(v) for top, v in zip(lp.top_logprobs, lp.token_logprobs))
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    chat = oai.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens  # one per returned token (a stop token is not returned)
    assert all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)
    streamed = list(oai.completions.create(model="smollm2", prompt="The sky is", max_tokens=5, temperature=0, logprobs=2,
                                           stream=True, extra_body={"ignore_eos": True}))
    assert [t for c in streamed for t in c.choices[0].logprobs.tokens] == lp.tokens


def test_openai_stop_string_is_not_returned(oai):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    full = oai.chat.completions.create(model="smollm2", messages=messages, max_tokens=24, temperature=0).choices[0].message.content
    cut = oai.chat.completions.create(model="smollm2", messages=messages, max_tokens=24, temperature=0, stop=["Paris"])
    assert cut.choices[0].message.content == full[: full.index("Paris")] and cut.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("kwargs, message", [
    ({"model": "gpt-4"}, "unknown model"),
    ({"max_tokens": 9000}, "exceeds the model's context"),
    ({"n": 65}, "n must be in \\[1, 64\\]"),
    ({"best_of": 2}, "unsupported parameter.*best_of"),
    ({"temperature": -1}, "temperature"),
    ({"prompt": ""}, "prompt is empty"),
    ({"logprobs": 50}, "logprobs must be in"),
    ({"echo": True}, "unsupported parameter"),
    ({"extra_body": {"logit_bias": {"99999999": 1.0}}}, "logit_bias has 99999999, outside the vocabulary"),
    ({"extra_body": {"min_p": 1.5}}, "min_p must be in"),
    ({"extra_body": {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}}},
     "the json constraint does not compile: Invalid type: objec"),
    ({"extra_body": {"structured_outputs": {"grammar": "root ::= missing"}}}, "Rule 'missing' not found"),
    ({"extra_body": {"response_format": {"type": "xml"}}}, "response_format.type must be one of"),
    ({"extra_body": {"tools": [{"type": "function", "function": {"name": "f"}}]}}, "unsupported parameter.*tools"),
])
def test_openai_bad_input_is_a_400_in_openai_shape(oai, kwargs, message):
    import openai

    args = {"model": "smollm2", "prompt": "Hello", "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError, match=message) as info:
        oai.completions.create(**args)
    assert info.value.status_code == 400 and info.value.body["type"] == "invalid_request_error"


def test_penalties_equal_the_reference_across_the_handoff(cluster, oai, reference):
    """The repetition penalty changes the first token, which prefill samples; frequency and
    presence change later ones, which decode samples. gRPC and HTTP both carry them."""
    model, tokenizer = reference
    prompt = text_prompt(tokenizer, 40)
    plain = reference_generate(model, prompt, 24, ignore_eos=True)
    want = reference_generate(model, prompt, 24, ignore_eos=True, repetition_penalty=2.0)
    assert want[0] != plain[0]
    assert cluster.generate(prompt_token_ids=prompt, max_tokens=24, ignore_eos=True, repetition_penalty=2.0).token_ids == want
    want = reference_generate(model, prompt, 24, ignore_eos=True, frequency_penalty=2.0, presence_penalty=1.5)
    assert want != plain
    got = cluster.generate(prompt_token_ids=prompt, max_tokens=24, ignore_eos=True, frequency_penalty=2.0, presence_penalty=1.5)
    assert got.token_ids == want
    done = oai.completions.create(model="smollm2", prompt=prompt, max_tokens=24, temperature=0,
                                  extra_body={"ignore_eos": True, "frequency_penalty": 2.0, "presence_penalty": 1.5})
    assert done.choices[0].text == tokenizer.decode(want, skip_special_tokens=True)


def test_logit_bias_equals_the_reference_across_the_handoff(cluster, oai, reference):
    """A bias that moves the first token (prefill samples it) and later ones (decode does)
    gives HF generate's ids with the same ``sequence_bias``, over gRPC and HTTP."""
    from transformers import GenerationConfig

    model, tokenizer = reference
    prompt = text_prompt(tokenizer, 40)
    plain = reference_generate(model, prompt, 16, ignore_eos=True)
    bias = {plain[0]: -100.0, plain[4]: -5.0}
    input_ids = torch.tensor([prompt])
    config = GenerationConfig(do_sample=False, max_new_tokens=16, eos_token_id=[], pad_token_id=0, sequence_bias={(t,): b for t, b in bias.items()})
    with torch.no_grad():
        want = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config)[0, len(prompt):].tolist()
    assert want[0] != plain[0]
    assert cluster.generate(prompt_token_ids=prompt, max_tokens=16, ignore_eos=True, logit_bias=bias).token_ids == want
    done = oai.completions.create(model="smollm2", prompt=prompt, max_tokens=16, temperature=0, logit_bias={str(t): b for t, b in bias.items()},
                                  extra_body={"ignore_eos": True})
    assert done.choices[0].text == tokenizer.decode(want, skip_special_tokens=True)


def grammar_reference(model, tokenizer, prompt: list[int], so, max_tokens: int) -> list[int]:
    """HF ``generate``, greedy, with llguidance's mask for ``so`` applied to each step's logits
    (an HF logits processor): the single-process reference of a constrained request. The ids
    end before EOS, as the cluster streams them."""
    from transformers import GenerationConfig, LogitsProcessorList

    from pdserve.structured import Grammars, apply_mask, fill_masks

    matcher = Grammars(tokenizer, model.config.vocab_size, [tokenizer.eos_token_id]).matcher(so)
    seen = []

    def mask(input_ids, scores):
        for token in input_ids[0, len(prompt):].tolist()[len(seen):]:
            assert matcher.consume_token(token)
            seen.append(token)
        return apply_mask(scores[0], fill_masks([matcher], model.config.vocab_size)[0])[None]

    input_ids = torch.tensor([prompt])
    config = GenerationConfig(do_sample=False, max_new_tokens=max_tokens, eos_token_id=tokenizer.eos_token_id, pad_token_id=0)
    with torch.no_grad():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config,
                             logits_processor=LogitsProcessorList([mask]))[0, len(prompt):].tolist()
    return out[:-1] if out and out[-1] == tokenizer.eos_token_id else out


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def test_structured_output_equals_the_reference_across_the_handoff(cluster, oai, reference):
    """A JSON schema over gRPC (the SDK's json_schema), OpenAI's response_format and vLLM's
    structured_outputs (chat, streamed or not): prefill samples token 1 under the mask and
    decode the rest, and the ids equal HF generate's under the same mask, ending in "stop"."""
    import json

    from pdserve.structured import StructuredOutput

    model, tokenizer = reference
    messages = [{"role": "user", "content": "Describe a person as JSON."}]
    prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
    want = grammar_reference(model, tokenizer, prompt, StructuredOutput("json", json.dumps(PERSON)), 40)
    assert set(json.loads(tokenizer.decode(want))) == {"name", "age"}
    got = cluster.generate(messages=messages, max_tokens=40, json_schema=PERSON)
    assert got.token_ids == want and got.finish_reason == "stop"
    schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    done = oai.chat.completions.create(model="smollm2", messages=messages, max_tokens=40, temperature=0, response_format=schema)
    assert done.choices[0].message.content == tokenizer.decode(want, skip_special_tokens=True) and done.choices[0].finish_reason == "stop"
    chunks = list(oai.chat.completions.create(model="smollm2", messages=messages, max_tokens=40, temperature=0, stream=True,
                                              extra_body={"structured_outputs": {"json": PERSON}}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == done.choices[0].message.content
    choice = ("red", "green", "blue")
    prompt = text_prompt(tokenizer, 30)
    want = grammar_reference(model, tokenizer, prompt, StructuredOutput("choice", choices=choice), 8)
    assert cluster.generate(prompt_token_ids=prompt, max_tokens=8, choice=list(choice)).token_ids == want
    done = oai.completions.create(model="smollm2", prompt=prompt, max_tokens=8, temperature=0, extra_body={"structured_outputs": {"choice": list(choice)}})
    assert done.choices[0].text == tokenizer.decode(want) and done.choices[0].text in choice


def test_twenty_json_schemas_give_replies_that_validate(oai):
    """The real openai client, response_format json_schema, 20 schemas at once: every reply
    parses and validates (jsonschema) and ends with "stop"."""
    from concurrent.futures import ThreadPoolExecutor
    import json

    import jsonschema

    from json_schemas import PROMPTS, SCHEMAS

    def ask(i):
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": SCHEMAS[i], "strict": True}}
        return oai.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": PROMPTS[i] + " Answer in JSON."}],
                                           max_tokens=160, temperature=0, response_format=fmt).choices[0]

    with ThreadPoolExecutor(len(SCHEMAS)) as pool:
        replies = list(pool.map(ask, range(len(SCHEMAS))))
    for schema, reply in zip(SCHEMAS, replies):
        assert reply.finish_reason == "stop", reply.message.content
        jsonschema.validate(json.loads(reply.message.content), schema)


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                                                           "unit": {"enum": ["celsius", "fahrenheit"]}},
                                                           "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "Current time in a time zone",
                                          "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}},
                                                         "required": ["zone"], "additionalProperties": False}}}


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_tool_calls_with_required_or_a_named_function_parse_and_validate(oai, tool_choice):
    """The reply is tool calls whose arguments validate against the function's schema,
    finish_reason "tool_calls"; streamed, the deltas carry the same calls."""
    import json

    import jsonschema

    messages = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
    done = oai.chat.completions.create(model="smollm2", messages=messages, tools=[WEATHER, CLOCK], tool_choice=tool_choice,
                                       max_tokens=80, temperature=0)
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice.message
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    if isinstance(tool_choice, dict):
        assert [c.function.name for c in choice.message.tool_calls] == ["get_time"]
    chunks = list(oai.chat.completions.create(model="smollm2", messages=messages, tools=[WEATHER, CLOCK], tool_choice=tool_choice,
                                              max_tokens=80, temperature=0, stream=True))
    deltas = [t for c in chunks for t in (c.choices[0].delta.tool_calls or [])]
    assert [(d.function.name, d.function.arguments) for d in deltas] == [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == (choice.message.content or "")


def test_a_tool_result_in_the_history_and_auto_give_an_answer_or_calls_never_an_error(oai):
    """A conversation with the assistant's call and the tool's result; with tool_choice auto
    the reply is content, or calls of a given function: text that does not parse stays content.
    Streamed, content and calls join to the same reply."""
    import json

    messages = [{"role": "user", "content": "What is the weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"}]
    done = oai.chat.completions.create(model="smollm2", messages=messages, tools=[WEATHER], max_tokens=48, temperature=0)
    choice = done.choices[0]
    assert choice.message.content or choice.message.tool_calls
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls" and all(c.function.name == "get_weather" for c in choice.message.tool_calls)
    chunks = list(oai.chat.completions.create(model="smollm2", messages=messages, tools=[WEATHER], max_tokens=48, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == (choice.message.content or "")
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason
    plain = oai.chat.completions.create(model="smollm2", messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=48, temperature=0)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content


@pytest.mark.parametrize("chat", [False, True])
def test_vllm_bench_serve_payloads_stream_to_the_end(cluster, reference, chat):
    """The exact bodies ``vllm bench serve --backend openai`` / ``openai-chat`` send (copies in
    test_openai_api.py): 200, every token streamed, the usage chunk last, the greedy answer."""
    import json
    import urllib.request

    from test_openai_api import VLLM_BENCH_CHAT, VLLM_BENCH_COMPLETIONS

    model, tokenizer = reference
    body = VLLM_BENCH_CHAT if chat else VLLM_BENCH_COMPLETIONS
    url = f"http://127.0.0.1:{HTTP_PORT}/v1/{'chat/completions' if chat else 'completions'}"
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json", "x-request-id": "b-1"})
    with urllib.request.urlopen(request, timeout=60) as r:
        assert r.status == 200
        events = [line.removeprefix(b"data: ").decode() for line in r.read().split(b"\n\n") if line.strip()]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == 8 and chunks[-1]["choices"] == []
    text = "".join((c["choices"][0]["delta"].get("content") or "") if chat else c["choices"][0]["text"] for c in chunks if c["choices"])
    if chat:
        prompt = list(tokenizer.apply_chat_template([{"role": "user", "content": "Hello there"}], add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
    else:
        prompt = tokenizer("Hello there").input_ids
    assert text == tokenizer.decode(reference_generate(model, prompt, 8, ignore_eos=True), skip_special_tokens=True)


def test_openai_malformed_body_is_a_400(cluster):
    import json
    import urllib.error
    import urllib.request

    request = urllib.request.Request(f"http://127.0.0.1:{HTTP_PORT}/v1/chat/completions", data=b'{"messages": "hi"}',
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=30)
    assert info.value.code == 400 and "messages" in json.loads(info.value.read())["error"]["message"]


def test_http_clients_that_disconnect_free_decode_at_once(cluster, reference):
    """Streaming and non-streaming HTTP clients that hang up mid-answer leave nothing behind,
    and their requests stop: 6 answers of 1,000 tokens would keep decode busy for about a
    minute, and the pools must be idle well before (router/disconnect.py)."""
    import http.client
    import json

    _, tokenizer = reference
    for i in range(6):
        body = json.dumps({"model": "smollm2", "prompt": text_prompt(tokenizer, 20 + i), "max_tokens": 1000,
                           "ignore_eos": True, "stream": i % 2 == 0})
        conn = http.client.HTTPConnection("127.0.0.1", HTTP_PORT, timeout=1.5)
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        try:
            response = conn.getresponse()
            response.read(200)  # a few events, then hang up
        except TimeoutError:
            pass  # the non-streaming ones: hang up while waiting
        conn.close()
    prefill, decode = wait_until_idle(20)
    assert decode["num_running"] == 0 and decode["num_used_blocks"] == 0 and prefill["num_held"] == 0, (decode, prefill)


def test_unknown_http_route_answers_in_openai_shape(cluster):
    import json
    import urllib.error
    import urllib.request

    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(f"http://127.0.0.1:{HTTP_PORT}/v1/nope", timeout=10)
    assert info.value.code == 404 and json.loads(info.value.read())["error"]["type"] == "invalid_request_error"


def test_prometheus_endpoint_has_the_pdserve_metrics(cluster):
    """After the requests above, Ray's metrics agent exports pdserve's metrics (vLLM's names
    with a pdserve_ prefix; Ray adds ray_). Ray reports every few seconds, hence the wait."""
    import time
    import urllib.request

    wanted = ["time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket", "e2e_request_latency_seconds_count",
              "prompt_tokens_total", "generation_tokens_total", 'request_success_total{', "num_requests_running",
              "num_requests_waiting", "kv_cache_usage_perc", "kv_blocks_used", "kv_blocks_total", "kv_transfer_bytes_total",
              "kv_transfer_seconds_count"]
    deadline, text = time.monotonic() + 60, ""
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=10) as r:
            text = r.read().decode()
        if all(f"ray_pdserve_{w}" in text for w in wanted):
            break
        time.sleep(2)
    missing = [w for w in wanted if f"ray_pdserve_{w}" not in text]
    assert not missing, missing
    lines = [line for line in text.splitlines() if line.startswith("ray_pdserve_request_success_total{") and 'finished_reason="length"' in line]
    assert lines and float(lines[0].rsplit(" ", 1)[1]) >= 1
    from kv_transfer import shm_backend

    transport = "shm" if shm_backend.available() else "grpc"  # auto on one node: shm, where its C block copy builds
    assert 'pool="decode"' in text and 'pool="prefill"' in text and f'transport="{transport}"' in text
    # per-replica gauges carry the replica's id; a pool's usage is blocks used over blocks in all
    usage = [line for line in text.splitlines() if line.startswith("ray_pdserve_kv_cache_usage_perc{")]
    assert usage and all('replica="' in line and 'replica=""' not in line for line in usage), usage
    assert all(0.0 <= float(line.rsplit(" ", 1)[1]) <= 1.0 for line in usage)


# -- n > 1 -------------------------------------------------------------------------------

def check_n_choices(cluster, oai, prompt: list[int]) -> None:
    """n = 4 with a seed, over gRPC and OpenAI, streamed or not: choice i is the request with
    seed + i alone (ids, logprobs, text), the prompt counts once in usage, every choice's in
    completion_tokens."""
    grpc_args = dict(prompt_token_ids=prompt, max_tokens=10, temperature=0.9, seed=40, logprobs=2, ignore_eos=True)
    alone = [cluster.generate(**{**grpc_args, "seed": 40 + i}) for i in range(4)]
    got = cluster.generate(**grpc_args, n=4)
    assert [c.token_ids for c in got.choices] == [a.token_ids for a in alone]
    assert [c.logprobs for c in got.choices] == [a.logprobs for a in alone]
    assert len({tuple(a.token_ids) for a in alone}) > 1 and (got.prompt_tokens, got.completion_tokens) == (len(prompt), 40)
    args = dict(model="smollm2", prompt=prompt, max_tokens=10, temperature=0.9, seed=40, logprobs=2, extra_body={"ignore_eos": True})
    done = oai.completions.create(n=4, **args)
    alone_http = [oai.completions.create(**{**args, "seed": 40 + i}).choices[0] for i in range(4)]
    assert [c.index for c in done.choices] == [0, 1, 2, 3]
    assert [c.text for c in done.choices] == [a.text for a in alone] == [a.text for a in alone_http]
    assert [c.logprobs.token_logprobs for c in done.choices] == [a.logprobs.token_logprobs for a in alone_http]
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (len(prompt), 40)
    chunks = list(oai.completions.create(n=4, stream=True, stream_options={"include_usage": True}, **args))
    texts, reasons = {}, {}
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            reasons[c.index] = c.finish_reason or reasons.get(c.index)
    assert texts == {i: c.text for i, c in enumerate(done.choices)} and reasons == {i: "length" for i in range(4)}
    assert chunks[-1].usage.completion_tokens == 40


def test_n_choices_each_equal_their_seed_alone_across_the_handoff(cluster, oai, reference):
    _, tokenizer = reference
    before = pool_stats("router")
    check_n_choices(cluster, oai, text_prompt(tokenizer, 45))
    assert pool_stats("router")["num_prefill_remote"] > before["num_prefill_remote"]
    messages = [{"role": "user", "content": "Name a colour."}]
    done = oai.chat.completions.create(model="smollm2", messages=messages, n=3, max_tokens=8, temperature=1.0, seed=5)
    chunks = list(oai.chat.completions.create(model="smollm2", messages=messages, n=3, max_tokens=8, temperature=1.0, seed=5, stream=True))
    texts = {}
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    assert texts == {i: c.message.content for i, c in enumerate(done.choices)}
    assert sorted(c.choices[0].index for c in chunks if c.choices[0].delta.role == "assistant") == [0, 1, 2]
    prefill, decode = wait_until_idle(60)
    assert prefill["num_held"] == 0 and decode["num_used_blocks"] == 0


def test_an_n_request_cancelled_mid_stream_frees_every_fork(cluster, reference):
    _, tokenizer = reference
    call = cluster.stream(prompt_token_ids=text_prompt(tokenizer, 60), max_tokens=200, temperature=1.0, seed=3, ignore_eos=True, n=4)
    for i, _ in enumerate(call):
        if i == 10:
            break
    call.cancel()
    prefill, decode = wait_until_idle(60)
    assert prefill["num_held"] == 0 and prefill["num_used_blocks"] == 0
    assert decode["num_running"] == 0 and decode["num_waiting"] == 0 and decode["num_used_blocks"] == 0


def test_nothing_is_left_held_or_running(cluster):
    prefill, decode = pool_stats("prefill"), pool_stats("decode")
    assert prefill["num_held"] == 0 and prefill["bytes_held"] == 0
    assert prefill["num_expired"] == 0  # every lease was acknowledged, none timed out
    for stats in (prefill, decode):
        assert stats["num_running"] == 0 and stats["num_waiting"] == 0
        assert stats["num_used_blocks"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]
