"""OpenAI tool calling: the request's ``tools`` and ``tool_choice``, the constraint that makes
``required`` and a named function always parse, the chat template that renders the tools and
the history's calls, and the parsers that turn the model's text back into ``tool_calls``.

Formats (``model.tool_parser``): ``hermes`` (Hermes, Qwen 2.5/3: each call is
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``) and ``llama3`` (Llama 3.1+:
the reply is one ``{"name": ..., "parameters": {...}}`` object, optionally after
``<|python_tag|>``, several separated by ``;``). ``auto`` picks llama3 for a template that
mentions ``<|python_tag|>`` or ``ipython``, else hermes. A model whose template has no tool
support (the bundled SmolLM2) gets ``HERMES_TEMPLATE`` (ChatML, Qwen 2.5's layout) for
requests with tools or tool messages, unless ``model.chat_template`` gives one.

``tool_choice``: ``none`` (tools rendered, text returned as is), ``auto`` (the model may call;
text that does not parse as calls of the given functions is returned as content),
``required`` (at least one call, constrained by the union of the functions' schemas),
or a named function (one call of it, constrained by its schema).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from pdserve.config import TOOL_PARSERS  # noqa: F401 - model.tool_parser's values, named here too
from pdserve.errors import InvalidRequestError
from pdserve.structured import JSON_DEFAULTS, StructuredOutput
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for a function name
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"

# ChatML with tools in Hermes' format, as Qwen 2.5's template lays them out.
HERMES_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0]['role'] == 'system' %}
{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message['role'] == 'user' or (message['role'] == 'system' and not loop.first) or (message['role'] == 'assistant' and not message.get('tool_calls')) %}
{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' }}
{%- elif message['role'] == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message['content'] %}{{- '\\n' + message['content'] }}{%- endif %}
{%- for call in message['tool_calls'] %}
{%- set f = call['function'] if call.get('function') else call %}
{{- '\\n<tool_call>\\n{"name": "' + f['name'] + '", "arguments": ' + (f['arguments'] | tojson) + '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message['role'] == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + (message['content'] or '') + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""


def supports_tools(template: str | None) -> bool:
    """Whether a chat template renders ``tools`` (it reads the variable)."""
    return bool(template) and re.search(r"\btools\b", template) is not None


def pick_parser(name: str, template: str | None) -> str:
    """``model.tool_parser`` settled against the template that renders the tools."""
    if name != "auto":
        return name
    return "llama3" if template and ("<|python_tag|>" in template or "ipython" in template) else "hermes"


@dataclass(frozen=True)
class ToolChoice:
    """The request's functions (OpenAI's ``function`` objects: name, description,
    parameters), ``mode`` ("none", "auto", "required" or "named"), the named function's name,
    and whether one reply may hold several calls (``parallel_tool_calls``)."""

    functions: tuple[dict, ...]
    mode: str
    named: str | None = None
    parallel: bool = True

    @property
    def tools(self) -> list[dict]:
        """The tools as chat templates take them (OpenAI's shape)."""
        return [{"type": "function", "function": f} for f in self.functions]

    def constraint(self, parser: str) -> StructuredOutput | None:
        """For ``required`` and a named function: a grammar whose every output is calls of the
        functions with arguments valid under their schemas; None otherwise."""
        if self.mode not in ("required", "named"):
            return None
        chosen = [f for f in self.functions if self.mode == "required" or f["name"] == self.named]
        key = "parameters" if parser == "llama3" else "arguments"
        calls = [{"type": "object", "properties": {"name": {"const": f["name"]}, key: f.get("parameters") or {"type": "object"}},
                  "required": ["name", key], "additionalProperties": False} for f in chosen]
        schema = json.dumps({"x-guidance": JSON_DEFAULTS, **(calls[0] if len(calls) == 1 else {"anyOf": calls})})
        many = self.parallel and self.mode == "required"
        if parser == "llama3":
            more = ' ("; " call)*' if many else ""
            lark = "start: call" + more + "\ncall: %json " + schema + "\n"
        else:
            more = ' ("\\n" call)*' if many else ""
            lark = ("start: call" + more + '\ncall: "' + HERMES_OPEN + '\\n" body "\\n' + HERMES_CLOSE + '"\nbody: %json ' + schema + "\n")
        return StructuredOutput("grammar", lark)


def parse_choice(tools: list | None, tool_choice: Any, parallel: bool | None) -> ToolChoice | None:
    """OpenAI's ``tools``, ``tool_choice`` and ``parallel_tool_calls``; None without tools.
    Raises InvalidRequestError naming what is wrong."""
    if tools is not None and not isinstance(tools, list):
        raise InvalidRequestError("tools must be a list of {\"type\": \"function\", \"function\": {...}}")
    functions = []
    for i, tool in enumerate(tools or []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise InvalidRequestError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\", ...}}}}")
        extra = sorted(set(fn) - {"name", "description", "parameters", "strict"})
        if extra:
            raise InvalidRequestError(f"tools[{i}].function.{extra[0]} is not a field of a function")
        if not isinstance(fn.get("name"), str) or not _NAME.match(fn["name"]):
            raise InvalidRequestError(f"tools[{i}].function.name must be 1-64 letters, digits, _ or -")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise InvalidRequestError(f"tools[{i}].function.parameters must be a JSON Schema object")
        functions.append({k: v for k, v in fn.items() if k != "strict" and v is not None})
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise InvalidRequestError("tools: two functions have the same name")
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name") if tool_choice.get("type") == "function" else None
        if not isinstance(name, str):
            raise InvalidRequestError("tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": {\"name\": ...}}")
        if name not in names:
            raise InvalidRequestError(f"tool_choice names {name!r}, which is not one of the tools")
        mode, named = "named", name
    elif tool_choice in (None, "none", "auto", "required"):
        mode, named = tool_choice or ("auto" if functions else "none"), None
    else:
        raise InvalidRequestError("tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": {\"name\": ...}}")
    if not functions:
        if mode in ("required", "named"):
            raise InvalidRequestError(f"tool_choice {tool_choice if isinstance(tool_choice, str) else 'naming a function'} needs tools")
        return None
    return ToolChoice(tuple(functions), mode, named, True if parallel is None else parallel)


def history_message(role: str, content: str | None, tool_calls: list | None, tool_call_id: str | None, where: str) -> dict:
    """A chat message as templates take it: an assistant's ``tool_calls`` with their
    ``arguments`` decoded from OpenAI's JSON text, a tool result with its ``tool_call_id``."""
    message: dict[str, Any] = {"role": role, "content": content}
    if tool_calls:
        if role != "assistant":
            raise InvalidRequestError(f"{where}.tool_calls: only an assistant message has tool calls")
        calls = []
        for i, call in enumerate(tool_calls):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise InvalidRequestError(f"{where}.tool_calls[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}")
            args = fn.get("arguments", "{}")
            try:
                args = json.loads(args) if isinstance(args, str) else args
            except ValueError:
                raise InvalidRequestError(f"{where}.tool_calls[{i}].function.arguments is not JSON") from None
            calls.append({"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}})
        message["tool_calls"] = calls
    if role == "tool":
        if not tool_call_id:
            raise InvalidRequestError(f"{where}: a tool message needs tool_call_id")
        message["tool_call_id"] = tool_call_id
    elif tool_call_id:
        raise InvalidRequestError(f"{where}.tool_call_id: only a tool message has one")
    return message


def _call(obj: Any, names: set[str]) -> dict | None:
    """A parsed ``{"name", "arguments"}`` (or ``"parameters"``) object as OpenAI's tool call,
    or None where it is not a call of one of ``names`` with an object of arguments."""
    args = obj.get("arguments", obj.get("parameters")) if isinstance(obj, dict) else None
    if not isinstance(args, dict) or obj.get("name") not in names:
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": obj["name"], "arguments": json.dumps(args)}}


def _json_objects(text: str, separator: str) -> list[Any] | None:
    """The JSON values of ``text``, one after another with ``separator`` (and spaces) between; None if it is not that."""
    decoder, values, at = json.JSONDecoder(), [], 0
    while True:
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            return None
        values.append(value)
        rest = text[at:].lstrip()
        if not rest:
            return values
        if not rest.startswith(separator):
            return None
        at = len(text) - len(rest[len(separator):].lstrip())


def parse_calls(text: str, parser: str, names: set[str]) -> tuple[str | None, list[dict]] | None:
    """(content, tool_calls) from a reply's text, or None where it holds no calls or they do
    not parse as calls of ``names`` (then the whole text is content)."""
    if parser == "llama3":
        body = text.strip().removeprefix("<|python_tag|>").strip()
        objects = _json_objects(body, ";") if body.startswith("{") else None
        calls = [_call(obj, names) for obj in objects or []]
        return (None, calls) if calls and None not in calls else None
    blocks = re.findall(re.escape(HERMES_OPEN) + r"\s*(.*?)\s*" + re.escape(HERMES_CLOSE), text, re.S)
    objects = [_json_objects(block, "\0") for block in blocks]
    calls = [_call(obj[0], names) if obj and len(obj) == 1 else None for obj in objects]
    if not calls or None in calls:
        return None
    rest = re.sub(re.escape(HERMES_OPEN) + r".*?" + re.escape(HERMES_CLOSE), "", text, flags=re.S).strip()
    if HERMES_OPEN in rest:  # a call left open (max_tokens): not a reply of calls
        return None
    return rest or None, calls


class CallStream:
    """A streamed reply split into content to send now and calls at the end: text from where
    a call may begin is held back (``push``), and ``finish`` parses the whole reply."""

    def __init__(self, parser: str, names: set[str], constrained: bool):
        self.parser, self.names, self.constrained = parser, names, constrained
        self.text, self.sent = "", 0  # the whole reply; how much of it went out as content

    def push(self, piece: str) -> str:
        """The content that can be streamed after ``piece`` arrives."""
        self.text += piece
        if self.constrained:
            return ""
        if self.parser == "llama3":
            head = self.text.lstrip()
            if head[:1] == "{" or head.startswith("<|python_tag|>") or "<|python_tag|>".startswith(head):
                return ""  # a reply of calls, or its start
            end = len(self.text)
        else:
            start = self.text.find(HERMES_OPEN)
            end = start if start >= 0 else len(self.text)
            if start < 0:  # hold back a tail that may be the start of "<tool_call>"
                end -= next((k for k in range(min(len(HERMES_OPEN) - 1, len(self.text)), 0, -1)
                             if HERMES_OPEN.startswith(self.text[-k:])), 0)
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return out

    def finish(self) -> tuple[str, list[dict]]:
        """(content not yet sent, tool_calls) once the reply has ended."""
        parsed = parse_calls(self.text, self.parser, self.names)
        if parsed is None:
            return self.text[self.sent:], []
        content, calls = parsed
        sent = self.text[: self.sent].strip()
        rest = (content or "")[len(sent):] if (content or "").startswith(sent) else ""
        return rest, calls
