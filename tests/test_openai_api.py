"""OpenAI request parsing (router/openai_api.py): nulls take defaults, wrong types and
unknown or unsupported parameters are refused by name."""

import json

import pytest

from pdserve.errors import InvalidRequestError
from router import openai_api as oa


def parse(cls, **body):
    return oa.parse(cls, json.dumps(body).encode())


def test_nulls_mean_defaults():
    req = parse(oa.CompletionRequest, prompt="Hi", model=None, temperature=None, top_p=None, n=None, stop=None)
    params = req.sampling_params(16)
    assert (params.temperature, params.top_p, params.max_tokens, params.stop) == (1.0, 1.0, 16, ())
    assert req.model is None  # the served model


def test_top_logprobs_out_of_range_is_named():
    req = parse(oa.ChatCompletionRequest, messages=[{"role": "user", "content": "Hi"}], logprobs=True, top_logprobs=25)
    with pytest.raises(InvalidRequestError, match=r"top_logprobs must be in \[0, 20\], got 25"):
        req.num_logprobs()


def test_an_infinite_temperature_is_refused_as_not_finite():
    params = parse(oa.CompletionRequest, prompt="Hi").sampling_params(16)
    params.temperature = float("inf")
    with pytest.raises(InvalidRequestError, match="temperature must be a finite number >= 0, got inf"):
        params.validate(1, 100)


@pytest.mark.parametrize("field, value", [("max_tokens", "10"), ("stream", "yes"), ("logprobs", True), ("temperature", "hot")])
def test_wrong_types_are_refused_naming_the_field(field, value):
    with pytest.raises(InvalidRequestError, match=field):
        parse(oa.CompletionRequest, prompt="Hi", **{field: value})


@pytest.mark.parametrize("field, value", [("response_format", {"type": "json_object"}), ("tools", [{"type": "function"}]),
                                          ("repetition_penalty", 1.3), ("n", 2), ("presence_penalty", 0.5)])
def test_unsupported_parameters_are_refused_not_ignored(field, value):
    with pytest.raises(InvalidRequestError, match=f"unsupported parameter.*{field}"):
        parse(oa.ChatCompletionRequest, messages=[{"role": "user", "content": "Hi"}], **{field: value})


def test_harmless_client_fields_are_accepted():
    req = parse(oa.ChatCompletionRequest, messages=[{"role": "user", "content": "Hi"}], user="u1", metadata={"k": "v"}, n=1)
    assert req.messages[0].text() == "Hi"


def test_non_text_content_and_empty_prompts_say_so():
    req = parse(oa.ChatCompletionRequest, messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    with pytest.raises(InvalidRequestError, match="image_url.*text only"):
        req.messages[0].text()
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        oa.completion_prompt(parse(oa.CompletionRequest, prompt=[]))
    with pytest.raises(InvalidRequestError, match="top_logprobs needs logprobs"):
        parse(oa.ChatCompletionRequest, messages=[{"role": "user", "content": "Hi"}], top_logprobs=2).sampling_params(8)


def test_a_stuck_worker_is_a_503_not_a_500():
    from pdserve.errors import WorkerStalledError

    assert oa.error_status(WorkerStalledError("engine step stuck")) == (503, "service_unavailable")


def test_a_seed_past_int64_is_refused_by_name():
    """gRPC carries seeds as int64; over HTTP a larger one is a 400 naming the range."""
    params = parse(oa.CompletionRequest, prompt="Hi", seed=2**64 + 5).sampling_params(16)
    with pytest.raises(InvalidRequestError, match=r"seed must be in \[0, 2\*\*63\), got 18446744073709551621"):
        params.validate(1, 100)
