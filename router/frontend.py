"""What both client APIs share: a request's prompt ids and checked sampling parameters, and
the typed stream of ``Output`` one request produces (``Router.generate``). The gRPC adapter
(``Router.generate_rpc`` behind router/grpc_server.py) and the HTTP adapter (router/http.py)
each parse their own request shape with ``Frontend`` and render the stream in their own
shape; neither goes through the other's types."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from pdserve.errors import InvalidRequestError
from pdserve.sampling import SamplingParams, TokenLogprob
from pdserve.structured import Grammars
from router.tool_calls import HERMES_TEMPLATE, pick_parser, supports_tools

CHAT_ROLES = ("system", "user", "assistant", "tool")
MAX_CHARS_PER_TOKEN = 64  # text longer than this many characters per context token is refused untokenized


@dataclass
class Output:
    """One piece of a request's answer: the tokens decode sent since the last piece, their
    text (detokenized, stop strings applied), and the counts so far. The last piece has
    ``finish_reason`` ("stop", "length", "abort"); with n > 1, each choice's last piece has."""

    token_ids: list[int]
    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token id, when asked for
    index: int = 0  # which choice (params.n > 1); completion_tokens counts every choice's


class Frontend:
    """Prompt and parameter checks against the served model: ``tokenizer`` (HF), the served
    ``model_name``, its context ``max_model_len`` (tokens) and ``vocab_size``. Every method
    raises InvalidRequestError naming what is wrong."""

    def __init__(self, tokenizer, model_name: str, max_model_len: int, vocab_size: int, chat_template: str | None = None,
                 tool_parser: str = "auto"):
        """``chat_template``: a Jinja chat template to use instead of the tokenizer's;
        ``tool_parser``: model.tool_parser (router/tool_calls.py)."""
        self.tokenizer, self.model_name, self.max_model_len, self.vocab_size = tokenizer, model_name, max_model_len, vocab_size
        self.chat_template = chat_template
        own = chat_template or getattr(tokenizer, "chat_template", None)
        # the template that renders tools: the model's own, else Hermes in ChatML where the model has ChatML's tokens
        self.tools_template = own if supports_tools(own) else HERMES_TEMPLATE if "<|im_start|>" in tokenizer.get_vocab() else None
        self.tool_parser = pick_parser(tool_parser, self.tools_template)
        self._grammars: Grammars | None = None
        self._grammars_lock = threading.Lock()

    @property
    def grammars(self) -> Grammars:
        """The grammar cache that checks structured output, built on first use (1-2 s; the router starts it at start-up)."""
        with self._grammars_lock:
            if self._grammars is None:
                eos = [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else []
                self._grammars = Grammars(self.tokenizer, self.vocab_size, eos)
            return self._grammars

    def check_model(self, model: str | None) -> None:
        if model and model != self.model_name:
            raise InvalidRequestError(f"unknown model {model!r}; this cluster serves {self.model_name!r}")

    def check_text_size(self, num_chars: int) -> None:
        """Refuse text far beyond the context before spending time tokenizing it."""
        limit = self.max_model_len * MAX_CHARS_PER_TOKEN
        if num_chars > limit:
            raise InvalidRequestError(f"prompt is {num_chars} characters, more than a {self.max_model_len}-token context can hold (limit {limit})")

    def text_ids(self, text: str) -> list[int]:
        self.check_text_size(len(text))
        return list(self.tokenizer(text).input_ids) if text else []

    def chat_ids(self, messages: list[tuple[str, str]] | list[dict], tools: list[dict] | None = None) -> list[int]:
        """``messages``: (role, content) pairs, or message dicts as chat templates take them
        (with an assistant's ``tool_calls`` and a tool's ``tool_call_id``:
        router/tool_calls.py ``history_message``); ``tools``: OpenAI's tool objects to render.
        The chat template (``chat_template``, else the model's; the tool-rendering one where
        there are tools or tool calls), with the generation prompt."""
        if not messages:
            raise InvalidRequestError("messages is empty: send at least one message")
        chat = [m if isinstance(m, dict) else {"role": m[0], "content": m[1]} for m in messages]
        self.check_text_size(sum(len(m.get("content") or "") for m in chat))
        for m in chat:
            if m["role"] not in CHAT_ROLES:
                raise InvalidRequestError(f"message role {m['role']!r} is not one of {', '.join(CHAT_ROLES)}")
        if not any((m.get("content") or "").strip() or m.get("tool_calls") for m in chat):
            raise InvalidRequestError("prompt is empty: every message has empty content")
        template = self.chat_template
        if tools or any(m.get("tool_calls") or m["role"] == "tool" for m in chat):
            if self.tools_template is None:
                raise InvalidRequestError("this model's chat template cannot render tools or tool messages: "
                                          "set model.chat_template to one that does")
            template = self.tools_template
        # tokenize/return_dict spelled out: transformers 4.x returns a bare id list by default, 5.x a dict
        return list(self.tokenizer.apply_chat_template(chat, tools=tools or None, chat_template=template, add_generation_prompt=True,
                                                       tokenize=True, return_dict=True)["input_ids"])

    def check_token_ids(self, name: str, ids: list[int]) -> None:
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"{name} has {bad[0]}, outside the vocabulary of {self.vocab_size}")

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """The checks every request gets, gRPC or HTTP."""
        self.check_token_ids("stop_token_ids", list(params.stop_token_ids))
        params.validate(len(prompt_ids), self.max_model_len, self.vocab_size)
        if params.structured is not None:  # compiled here, so a bad one is refused before prefill runs
            self.grammars.check(params.structured)
