"""OpenAI request parsing (router/openai_api.py): nulls take defaults, wrong types and
unknown or unsupported parameters are refused by name."""

import json
import re

import pytest

from pdserve.errors import InvalidRequestError
from pdserve.structured import StructuredOutput
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


@pytest.mark.parametrize("field, value", [("best_of", 2), ("functions", [{"name": "f"}])])
def test_unsupported_parameters_are_refused_not_ignored(field, value):
    with pytest.raises(InvalidRequestError, match=f"unsupported parameter.*{field}"):
        parse(oa.ChatCompletionRequest, messages=[{"role": "user", "content": "Hi"}], **{field: value})


def test_tools_are_refused_on_completions_and_parsed_on_chat():
    """Completions has no tools (a 400 naming them); chat checks them (router/tool_calls.py)."""
    tools = [{"type": "function", "function": {"name": "f"}}]
    with pytest.raises(InvalidRequestError, match="unsupported parameter.*parallel_tool_calls, tool_choice, tools"):
        parse(oa.CompletionRequest, prompt="Hi", tools=tools, tool_choice="auto", parallel_tool_calls=False)
    req = parse(oa.ChatCompletionRequest, messages=[{"role": "user", "content": "Hi"}], tools=tools, tool_choice="required",
                parallel_tool_calls=False)
    choice = req.tool_choice_()
    assert (choice.mode, choice.parallel, [f["name"] for f in choice.functions]) == ("required", False, ["f"])
    with pytest.raises(InvalidRequestError, match="tool_choice required needs tools"):
        parse(oa.ChatCompletionRequest, messages=[{"role": "user", "content": "Hi"}], tool_choice="required").tool_choice_()


def test_neutral_values_of_unimplemented_fields_are_accepted():
    """What OpenAI does when a field is left out; LangChain and other clients send these by default."""
    req = parse(oa.ChatCompletionRequest, messages=[{"role": "user", "content": "Hi"}], response_format={"type": "text"},
                tool_choice="none", parallel_tool_calls=False, tools=[], n=1, logit_bias={}, min_p=0.0, functions=[],
                function_call="auto")
    assert req.sampling_params(8).max_tokens == 8
    parse(oa.ChatCompletionRequest, messages=[{"role": "user", "content": "Hi"}], tool_choice="auto", parallel_tool_calls=True)


def test_penalties_pass_through_with_vllms_names():
    params = parse(oa.CompletionRequest, prompt="Hi", repetition_penalty=1.3, presence_penalty=0.5,
                   frequency_penalty=-0.25).sampling_params(16)
    assert (params.repetition_penalty, params.presence_penalty, params.frequency_penalty) == (1.3, 0.5, -0.25)
    with pytest.raises(InvalidRequestError, match="presence_penalty must be in"):
        parse(oa.CompletionRequest, prompt="Hi", presence_penalty=3.0).sampling_params(16).validate(1, 100)


def test_logit_bias_and_min_p_pass_through_as_vllm_takes_them():
    """OpenAI's string token ids become ints; biases beyond +-100 are clamped, as vLLM's server does."""
    params = parse(oa.ChatCompletionRequest, messages=[{"role": "user", "content": "Hi"}], logit_bias={"5": 2.5, "7": -250, "9": 1e9},
                   min_p=0.05).sampling_params(16)
    assert params.logit_bias == {5: 2.5, 7: -100.0, 9: 100.0} and params.min_p == 0.05
    params.validate(1, 100)
    with pytest.raises(InvalidRequestError, match="logit_bias key 'five' is not a token id"):
        parse(oa.CompletionRequest, prompt="Hi", logit_bias={"five": 1.0}).sampling_params(16)
    with pytest.raises(InvalidRequestError, match=r"min_p must be in \[0, 1\]"):
        parse(oa.CompletionRequest, prompt="Hi", min_p=1.5).sampling_params(16).validate(1, 100)


# The bodies vLLM 0.32's ``vllm bench serve`` sends (vllm/benchmarks/lib/endpoint_request_func.py), with
# --temperature 0 --ignore-eos; tests/cluster/test_e2e.py posts them to a running cluster.
VLLM_BENCH_COMPLETIONS = {"model": "smollm2", "prompt": "Hello there", "repetition_penalty": 1.0, "max_tokens": 8, "logprobs": None,
                          "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0.0}
VLLM_BENCH_CHAT = {"model": "smollm2", "messages": [{"role": "user", "content": [{"type": "text", "text": "Hello there"}]}],
                   "max_completion_tokens": 8, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
                   "temperature": 0.0}


def test_vllm_bench_serve_payloads_parse():
    completion = parse(oa.CompletionRequest, **VLLM_BENCH_COMPLETIONS)
    assert completion.sampling_params(16).repetition_penalty == 1.0 and completion.num_logprobs() is None
    chat = parse(oa.ChatCompletionRequest, **VLLM_BENCH_CHAT)
    assert chat.messages[0].text() == "Hello there" and chat.sampling_params(16).ignore_eos


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
    with pytest.raises(InvalidRequestError, match=r"seed must be in \[0, 2\*\*63 - n\] \(choice i takes seed \+ i\), got 18446744073709551621"):
        params.validate(1, 100)


def test_n_reaches_the_sampling_parameters_and_is_checked():
    assert parse(oa.ChatCompletionRequest, messages=[{"role": "user", "content": "Hi"}], n=3).sampling_params(16).n == 3
    assert parse(oa.CompletionRequest, prompt="Hi").sampling_params(16).n == 1
    with pytest.raises(InvalidRequestError, match=r"n must be in \[1, 64\], got 0"):
        parse(oa.CompletionRequest, prompt="Hi", n=0).sampling_params(16).validate(1, 100)
    with pytest.raises(InvalidRequestError, match="n"):
        parse(oa.CompletionRequest, prompt="Hi", n="2")


def test_an_error_names_the_field_it_is_about_as_openais_param():
    """``param`` is the request field an error message starts with, as OpenAI's errors carry it."""
    assert oa.error_body("max_tokens must be >= 1, got 0", "invalid_request_error", 400)["error"]["param"] == "max_tokens"
    with pytest.raises(InvalidRequestError) as wrong_type:
        parse(oa.CompletionRequest, prompt=5)
    assert oa.error_body(str(wrong_type.value), "invalid_request_error", 400)["error"]["param"] == "prompt"
    assert oa.error_body("top_logprobs needs logprobs: true", "invalid_request_error", 400)["error"]["param"] == "top_logprobs"
    assert oa.error_body("unsupported parameter(s) for pdserve: n, echo", "invalid_request_error", 400)["error"]["param"] == "n"
    assert oa.error_body("unknown model 'x'; this cluster serves 'smollm2'", "invalid_request_error", 400)["error"]["param"] == "model"
    assert oa.error_body("message role 'robot' is not one of system, user", "invalid_request_error", 400)["error"]["param"] == "messages"
    assert oa.error_body("server busy", "invalid_request_error", 429)["error"]["param"] is None
    assert oa.error_body("server busy", "rate_limit_error", 429)["error"] == {"message": "server busy", "type": "rate_limit_error", "param": None, "code": 429}


def test_a_value_no_member_of_a_union_takes_names_the_field_and_what_it_takes():
    with pytest.raises(InvalidRequestError, match=r"^prompt must be one of: str, list\[int\], list\[str\], list\[list\[int\]\]; got 5$"):
        parse(oa.CompletionRequest, prompt=5)
    with pytest.raises(InvalidRequestError, match=r"^messages\.0\.content must be one of: str, list\[ContentPart\]; got 5$"):
        parse(oa.ChatCompletionRequest, messages=[{"role": "user", "content": 5}])
    with pytest.raises(InvalidRequestError, match=r"^stop must be one of: str, list\[str\]; got 5$"):
        parse(oa.CompletionRequest, prompt="Hi", stop=5)


def test_stream_options_without_stream_are_refused():
    with pytest.raises(InvalidRequestError, match="stream_options is only allowed when stream is true"):
        parse(oa.CompletionRequest, prompt="Hi", stream_options={"include_usage": True})
    assert parse(oa.CompletionRequest, prompt="Hi", stream=True, stream_options={"include_usage": True}).stream_options.include_usage
    assert parse(oa.CompletionRequest, prompt="Hi", stream=False, stream_options=None).stream_options is None
    assert oa.error_body("stream_options is only allowed when stream is true", "invalid_request_error", 400)["error"]["param"] == "stream_options"


def test_unknown_stream_options_keys_are_refused_by_name():
    with pytest.raises(InvalidRequestError, match=r"unsupported parameter.*stream_options\.continuous_usage_stats"):
        parse(oa.CompletionRequest, prompt="Hi", stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    assert parse(oa.CompletionRequest, prompt="Hi", stream=True, stream_options={"include_usage": True}).stream_options.include_usage
    body = oa.error_body("unsupported parameter(s) for pdserve: stream_options.continuous_usage_stats", "invalid_request_error", 400)
    assert body["error"]["param"] == "stream_options.continuous_usage_stats"


@pytest.mark.parametrize("field, value", [("name", "alice"), ("refusal", "no")])
def test_unknown_message_fields_are_refused_by_name(field, value):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi", field: value}]
    with pytest.raises(InvalidRequestError, match=rf"unsupported parameter.*messages\[1\]\.{field}"):
        parse(oa.ChatCompletionRequest, messages=messages)
    messages[1][field] = None  # null changes nothing
    assert parse(oa.ChatCompletionRequest, messages=messages).messages[1].text() == "Hi"


def test_unknown_content_part_keys_are_refused_by_name():
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}}]}]
    with pytest.raises(InvalidRequestError, match=r"messages\[0\]\.content\[0\]\.cache_control"):
        parse(oa.ChatCompletionRequest, messages=messages)


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("cls, prompt", [(oa.ChatCompletionRequest, {"messages": [{"role": "user", "content": "Hi"}]}),
                                         (oa.CompletionRequest, {"prompt": "Hi"})])
@pytest.mark.parametrize("fields, expected", [
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutput("json_object")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}},
     StructuredOutput("json", json.dumps(SCHEMA))),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOutput("json", json.dumps(SCHEMA))),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, StructuredOutput("json", json.dumps(SCHEMA))),
    ({"structured_outputs": {"regex": "[a-z]+"}}, StructuredOutput("regex", "[a-z]+")),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, StructuredOutput("choice", choices=("yes", "no"))),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, StructuredOutput("grammar", 'root ::= "a"')),
    ({"structured_outputs": {"json_object": True, "regex": None}}, StructuredOutput("json_object")),
])
def test_response_format_and_structured_outputs_become_one_constraint(cls, prompt, fields, expected):
    """OpenAI's response_format and vLLM's structured_outputs, on chat and completions alike."""
    assert parse(cls, **prompt, **fields).sampling_params(8).structured == expected


@pytest.mark.parametrize("fields, message", [
    ({"response_format": {"type": "xml"}}, "response_format.type must be one of text, json_object, json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": [1]}}, "response_format.json_schema must be an object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}}, "response_format.json_schema.schema must be a JSON Schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA, "bogus": 1}}}, "response_format.json_schema.bogus"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "set one of them, not both"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one of json, regex, choice, grammar, json_object; got 2"),
    ({"structured_outputs": {}}, "exactly one of"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag is not supported"),
    ({"structured_outputs": {"choice": "yes"}}, "structured_outputs.choice must be a list of strings"),
    ({"structured_outputs": {"regex": 5}}, "structured_outputs.regex must be a string"),
])
def test_bad_structured_output_fields_are_refused_by_name(fields, message):
    req = parse(oa.ChatCompletionRequest, messages=[{"role": "user", "content": "Hi"}], **fields)
    with pytest.raises(InvalidRequestError, match=re.escape(message)):
        req.sampling_params(8)
