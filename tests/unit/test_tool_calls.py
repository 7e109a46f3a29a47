"""Tool calling's pieces (router/tool_calls.py): the request's tools and tool_choice checked
by name, the Hermes template rendering tools and a history of calls and results for the
bundled model, the constraint of ``required`` / a named function compiling and admitting
exactly calls, the parsers, and the stream that holds back what may be a call."""

import json
import re

import pytest

from pdserve.errors import InvalidRequestError
from pdserve.model_loader import load_tokenizer
from pdserve.structured import Grammars
from router import http
from router.frontend import Frontend
from router.tool_calls import CallStream, parse_calls, parse_choice

WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                          "required": ["city"], "additionalProperties": False}}
TIME = {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}
TOOLS = [{"type": "function", "function": WEATHER}, {"type": "function", "function": TIME}]


@pytest.fixture(scope="module")
def frontend(real_model_dir):
    return Frontend(load_tokenizer(real_model_dir), "smollm2", max_model_len=4096, vocab_size=49152)


@pytest.mark.parametrize("tools, choice, message", [
    ([{"type": "function"}], None, "tools[0] must be"),
    ([{"type": "function", "function": {"name": "bad name"}}], None, "tools[0].function.name must be 1-64 letters"),
    ([{"type": "function", "function": {"name": "f", "parameters": 3}}], None, "tools[0].function.parameters must be a JSON Schema"),
    ([{"type": "function", "function": {"name": "f", "returns": {}}}], None, "tools[0].function.returns is not a field"),
    (TOOLS + TOOLS[:1], None, "two functions have the same name"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice names 'nope', which is not one of the tools"),
    (TOOLS, "sometimes", "tool_choice must be none, auto, required"),
    (None, "required", "tool_choice required needs tools"),
])
def test_bad_tools_and_tool_choices_are_refused_by_name(tools, choice, message):
    with pytest.raises(InvalidRequestError, match=re.escape(message)):
        parse_choice(tools, choice, None)


def test_the_default_choice_is_auto_with_tools_and_none_without():
    assert parse_choice(TOOLS, None, None).mode == "auto"
    assert parse_choice(None, None, None) is None and parse_choice([], "auto", None) is None
    named = parse_choice(TOOLS, {"type": "function", "function": {"name": "get_time"}}, False)
    assert (named.mode, named.named, named.parallel) == ("named", "get_time", False)


def test_the_hermes_template_renders_tools_calls_and_results_for_the_bundled_model(frontend):
    """SmolLM2's own template has no tools: the ChatML Hermes one renders them, the assistant's
    earlier call and the tool's answer; a chat without tools keeps the model's template."""
    assert frontend.tool_parser == "hermes"
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                                       "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
               {"role": "tool", "content": "18 C, sunny", "tool_call_id": "c1"}]
    text = frontend.tokenizer.decode(frontend.chat_ids(history, [{"type": "function", "function": WEATHER}]))
    assert "<tools>\n" + json.dumps({"type": "function", "function": WEATHER}) in text
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>' in text
    assert "<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n" in text
    plain = frontend.chat_ids([("user", "Hi")])
    assert plain == list(frontend.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                                                 tokenize=True, return_dict=True)["input_ids"])


def test_history_messages_are_checked_by_name(frontend):
    bad = [({"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}, "only an assistant message"),
           ({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}, "arguments is not JSON"),
           ({"role": "tool", "content": "x"}, "a tool message needs tool_call_id")]
    for message, error in bad:
        body = {"messages": [{"role": "user", "content": "Hi"}, message], "tools": TOOLS}
        with pytest.raises(InvalidRequestError, match=error):
            http.parse(frontend, json.dumps(body).encode(), chat=True)


@pytest.mark.parametrize("parser", ["hermes", "llama3"])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_the_constraint_of_required_and_named_admits_calls_only(frontend, parser, choice):
    """The grammar compiles, takes a call of the right shape and refuses text, a call of
    another function (named) and arguments outside the schema."""
    so = parse_choice(TOOLS, choice, True).constraint(parser)
    grammars = Grammars(frontend.tokenizer, 49152, [2])
    ok = {"name": "get_weather", ("parameters" if parser == "llama3" else "arguments"): {"city": "Paris", "unit": "C"}}
    wrap = (lambda s: s) if parser == "llama3" else (lambda s: f"<tool_call>\n{s}\n</tool_call>")

    def accepts(text: str) -> bool:
        matcher = grammars.matcher(so)
        return matcher.consume_tokens(frontend.tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()

    assert accepts(wrap(json.dumps(ok)))
    assert not accepts("The weather is nice.")
    assert not accepts(wrap(json.dumps({**ok, ("parameters" if parser == "llama3" else "arguments"): {"town": "Paris"}})))
    other = wrap(json.dumps({"name": "get_time", ("parameters" if parser == "llama3" else "arguments"): {"zone": "UTC"}}))
    assert accepts(other) == (choice == "required")


def test_parsers_return_calls_or_nothing():
    names = {"get_weather"}
    content, calls = parse_calls('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>', "hermes", names)
    assert content == "Let me check." and calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert parse_calls("no call here", "hermes", names) is None
    assert parse_calls('<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>', "hermes", names) is None  # not a given function
    assert parse_calls('<tool_call>\n{"name": "get_weather", "argu', "hermes", names) is None  # cut at max_tokens
    content, calls = parse_calls('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}', "llama3", names)
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"city": "Rome"}
    assert parse_calls('{"answer": 4}', "llama3", names) is None


def test_a_stream_holds_back_what_may_be_a_call_and_sends_the_calls_at_the_end():
    text = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    stream = CallStream("hermes", {"get_weather"}, constrained=False)
    sent = "".join(stream.push(text[i:i + 3]) for i in range(0, len(text), 3))
    assert sent == "Checking.\n"  # "<tool" and what follows never went out as content
    rest, calls = stream.finish()
    assert rest == "" and calls[0]["function"]["name"] == "get_weather"
    plain = CallStream("hermes", {"get_weather"}, constrained=False)
    sent = "".join(plain.push(p) for p in ["a <", "tool", " b"])
    rest, calls = plain.finish()
    assert sent + rest == "a <tool b" and calls == []
