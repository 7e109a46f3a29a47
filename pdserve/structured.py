"""Structured output: a request's tokens constrained to a JSON schema, any JSON object, a
regex, one of several strings, or a grammar, by llguidance's token masks.

The router checks a request's grammar before prefill runs (``Grammars.check``: a bad one is
an InvalidRequestError naming the problem), and each engine builds the request's matcher
before its first step (``Grammars.matcher``), off the step thread, from the same grammar,
having it accept the tokens generated so far: a decode replica taking a request after
prefill's first token, or a migrated or recomputed one, is then in the state that one
process would be in. The engine fills each constrained row's mask while the step's forward
runs (``fill_masks``), and its sampler applies it to the row's logits before anything else
(engine/sampler.py; ``apply_mask`` here is the one-row reference).

Why llguidance (docs/structured_output.md has the measurement): it builds a matcher in
about 1 ms where xgrammar 0.2 takes 6 ms, its masks take 15-50 us a token (xgrammar's
8 us; both are well under 1% of a decode step), it has no dependency (xgrammar pulls in
triton and tvm-ffi), and it reads JSON schema, regex, Lark and, converted, GBNF.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from pdserve.errors import InvalidRequestError

KINDS = ("json", "json_object", "regex", "choice", "grammar")
# JSON as json.dumps writes it, and no free whitespace: a small model given free whitespace can
# emit newlines until max_tokens. A schema's own "x-guidance" options override these.
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_SPEC_CHARS = 1 << 18  # a schema, regex or grammar longer than this many characters is refused
CACHE_SIZE = 256  # compiled grammars kept per process, least recently used dropped first
_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must match. ``kind``: "json" (``spec`` a JSON Schema as JSON
    text), "json_object" (any JSON object; ``spec`` empty), "regex" (``spec`` a regular
    expression the whole output matches, Rust regex syntax with ASCII ``\\d`` and ``\\w``), "choice" (exactly one of
    ``choices``) or "grammar" (``spec`` a Lark grammar as llguidance reads it, or a GBNF/EBNF
    one with ``::=`` rules, converted to Lark)."""

    kind: str
    spec: str = ""
    choices: tuple[str, ...] = ()

    def validate(self) -> None:
        """The checks that need no tokenizer. Raises InvalidRequestError."""
        if self.kind not in KINDS:
            raise InvalidRequestError(f"structured output kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if len(self.spec) > MAX_SPEC_CHARS:
            raise InvalidRequestError(f"the {self.kind} constraint is {len(self.spec)} characters, more than {MAX_SPEC_CHARS}")
        if self.kind in ("json", "regex", "grammar") and not self.spec:
            raise InvalidRequestError(f"the {self.kind} constraint is empty")
        if self.kind == "choice" and (not self.choices or any(not c for c in self.choices)):
            raise InvalidRequestError("choice needs at least one choice, and no empty string")
        if self.kind == "choice" and sum(map(len, self.choices)) > MAX_SPEC_CHARS:
            raise InvalidRequestError(f"choice's strings total more than {MAX_SPEC_CHARS} characters")

    @property
    def key(self) -> str:
        """sha256 of kind, spec and choices: the compiled-grammar cache's key."""
        return hashlib.sha256(json.dumps([self.kind, self.spec, list(self.choices)]).encode()).hexdigest()

    def grammar(self) -> str:
        """The llguidance grammar (its JSON or Lark text). Raises InvalidRequestError for a
        schema that is not a JSON object or a GBNF grammar that does not convert."""
        import llguidance

        self.validate()
        if self.kind in ("json", "json_object"):
            schema = self.spec if self.kind == "json" else '{"type": "object"}'
            try:
                if not isinstance(json.loads(schema), dict):
                    raise ValueError("a JSON Schema is a JSON object")
                return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
            except ValueError as e:
                raise InvalidRequestError(f"json schema: {e}") from None
        if self.kind == "regex":  # \d and \w in ASCII, as in JSON Schema's patterns (ECMA-262), not all of Unicode's digits
            return llguidance.LLMatcher.grammar_from_lark(f"start: /{llguidance.regex_to_lark(self.spec, 'dw')}/")
        if self.kind == "choice":  # JSON string literals are Lark's string literals
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in self.choices))
        lark = self.spec
        if re.search(r"^\s*[A-Za-z_][\w-]*\s*::=", lark, re.M):  # a GBNF rule (Lark's are "name: ...")
            from llguidance.gbnf_to_lark import gbnf_to_lark

            try:
                lark = gbnf_to_lark(lark)
            except Exception as e:  # noqa: BLE001 - the converter raises plain exceptions for bad input
                raise InvalidRequestError(f"grammar (GBNF) does not convert to Lark: {e}") from None
        return llguidance.LLMatcher.grammar_from_lark(lark)


def _one_line(message: str) -> str:
    """llguidance's multi-line error (with caret lines under the bad spot) as one line."""
    return "; ".join(line.strip() for line in message.splitlines() if line.strip().strip("^"))


class Grammars:
    """Grammars compiled for one tokenizer, cached by ``StructuredOutput.key`` (an LRU of
    ``cache_size``), and matchers built from them. Thread-safe.

    ``tokenizer``: the served model's HF (fast) tokenizer; ``vocab_size``: logits per row
    (masks have ``ceil(vocab_size / 32)`` int32 words); ``eos_token_ids``: the tokens that
    end a grammar's output. Building the llguidance tokenizer and its first mask (which
    builds the tables every later mask reads, ~1 s on its own) takes 1-2 s for the bundled
    model's 49k tokens: done here, so that no request's step pays it.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, cache_size: int = CACHE_SIZE):
        import llguidance.hf

        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids) or None
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=self.eos_token_ids)
        warm = llguidance.LLMatcher(self.tokenizer, llguidance.LLMatcher.grammar_from_regex("[a-z]+"), log_level=0)
        fill_masks([warm], vocab_size)
        self.cache_size = cache_size
        self._cache: OrderedDict[str, object] = OrderedDict()  # key -> an LLMatcher in its start state
        self._lock = threading.Lock()
        self.num_compiled = 0  # cache misses, for tests and stats

    def _compiled(self, so: StructuredOutput):
        """The start-state matcher of ``so`` (compiled here on a miss). Raises InvalidRequestError."""
        import llguidance

        key = so.key
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
                return template
        template = llguidance.LLMatcher(self.tokenizer, so.grammar(), log_level=0)  # the grammar's errors land in its state
        if template.is_error():
            raise InvalidRequestError(f"the {so.kind} constraint does not compile: {_one_line(template.get_error())}")
        with self._lock:
            self.num_compiled += 1
            self._cache[key] = template
            self._cache.move_to_end(key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return template

    def check(self, so: StructuredOutput) -> None:
        """Raises InvalidRequestError naming why ``so`` cannot be served (and caches it if it can)."""
        self._compiled(so)

    def matcher(self, so: StructuredOutput, generated: list[int] = ()):
        """A fresh llguidance ``LLMatcher`` for ``so`` that has accepted ``generated`` (the
        request's tokens so far). Raises InvalidRequestError if the grammar does not compile
        or the tokens do not follow it."""
        matcher = self._compiled(so).deep_copy()
        if generated and not matcher.consume_tokens(list(generated)):
            raise InvalidRequestError(f"the tokens generated so far do not follow the {so.kind} constraint: {matcher.get_error()}")
        return matcher

    def __len__(self) -> int:
        return len(self._cache)


def fill_masks(matchers: list, vocab_size: int) -> torch.Tensor:
    """Each matcher's allowed next tokens: ``[len(matchers), ceil(vocab_size / 32)]`` int32,
    bit ``t % 32`` of word ``t // 32`` set where token t is allowed."""
    masks = torch.zeros((len(matchers), (vocab_size + 31) // 32), dtype=torch.int32)
    for i, matcher in enumerate(matchers):  # llguidance.torch.fill_next_token_bitmask's call, without importing that
        row = masks[i]  # module: it applies torch.compile at import, which loads TorchDynamo (~2 s a process)
        matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
    return masks


def apply_mask(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``logits: [vocab]`` with -inf where ``mask: [ceil(vocab / 32)]`` int32 (``fill_masks``)
    has the token's bit clear (a new tensor, same dtype and device; the mask may be on the CPU)."""
    vocab = logits.shape[-1]
    mask = mask.to(logits.device, non_blocking=True)
    allowed = ((mask.view(-1, 1) >> _BIT_SHIFTS.to(logits.device)) & 1).flatten()[:vocab].bool()  # [vocab]
    return logits.masked_fill(~allowed, float("-inf"))
