"""The checks both client APIs share (router/frontend.py), on the bundled model's tokenizer,
without a cluster; and the HTTP adapter parsing through it (router/http.py)."""

import json

import pytest

from pdserve.errors import InvalidRequestError
from pdserve.sampling import SamplingParams
from router import http
from router.frontend import Frontend


@pytest.fixture(scope="module")
def frontend(real_model_dir):
    from pdserve.model_loader import load_tokenizer

    return Frontend(load_tokenizer(real_model_dir), "smollm2", max_model_len=64, vocab_size=49152)


def test_text_and_chat_prompts_become_the_tokenizers_ids(frontend):
    assert frontend.text_ids("Hello there") == list(frontend.tokenizer("Hello there").input_ids)
    chat = frontend.chat_ids([("user", "Hi")])
    assert chat == list(frontend.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])


@pytest.mark.parametrize("call, message", [
    (lambda f: f.check_model("other"), "unknown model 'other'; this cluster serves 'smollm2'"),
    (lambda f: f.chat_ids([]), "messages is empty"),
    (lambda f: f.chat_ids([("robot", "Hi")]), "message role 'robot' is not one of"),
    (lambda f: f.chat_ids([("user", "  ")]), "prompt is empty"),
    (lambda f: f.text_ids("x" * (64 * 64 + 1)), "prompt is 4097 characters, more than a 64-token context can hold"),
    (lambda f: f.check_token_ids("prompt", [5, 49152]), "prompt has 49152, outside the vocabulary of 49152"),
    (lambda f: f.validate([1] * 60, SamplingParams(max_tokens=8)), "64"),
])
def test_each_bad_request_is_refused_by_name(frontend, call, message):
    with pytest.raises(InvalidRequestError, match=message.replace("(", r"\(").replace(")", r"\)")):
        call(frontend)


def test_the_http_adapter_parses_openai_bodies_through_the_frontend(frontend):
    req, ids, params = http.parse(frontend, json.dumps({"model": "smollm2", "prompt": [5, 6, 7], "max_tokens": 3}).encode(), chat=False)
    assert ids == [5, 6, 7] and params.max_tokens == 3 and not req.stream
    _, ids, params = http.parse(frontend, json.dumps({"messages": [{"role": "user", "content": "Hi"}]}).encode(), chat=True)
    assert ids == frontend.chat_ids([("user", "Hi")]) and params.max_tokens == 64 - len(ids)  # the rest of the context
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        http.parse(frontend, json.dumps({"prompt": [49152]}).encode(), chat=False)


def test_a_constraint_is_compiled_by_the_frontend_before_any_worker_sees_it(frontend):
    from pdserve.structured import StructuredOutput

    frontend.validate([1, 2], SamplingParams(max_tokens=4, structured=StructuredOutput("regex", "[a-z]+")))
    with pytest.raises(InvalidRequestError, match="the json constraint does not compile: Invalid type: objec"):
        frontend.validate([1, 2], SamplingParams(max_tokens=4, structured=StructuredOutput("json", '{"type": "objec"}')))
    with pytest.raises(InvalidRequestError, match=r"response_format.type must be one of text, json_object, json_schema"):
        http.parse(frontend, json.dumps({"prompt": "Hi", "response_format": {"type": "yaml"}}).encode(), chat=False)
    _, _, params = http.parse(frontend, json.dumps({"messages": [{"role": "user", "content": "Hi"}], "response_format": {"type": "json_object"}}).encode(), chat=True)
    assert params.structured == StructuredOutput("json_object") and len(frontend.grammars) == 2
