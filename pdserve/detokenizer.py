"""Incremental detokenization for streaming.

Each chunk of new text is decoded from a short window of recent tokens
(``ids[prefix_offset:]``) as in vLLM and TGI, and held back while it ends in an
incomplete UTF-8 sequence (U+FFFD), so every streamed chunk is valid text.
``finish`` returns the rest, so the joined chunks equal ``tokenizer.decode(ids)``.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # start of the decode window
        self.read_offset = 0  # tokens before this are already emitted as text
        self.num_chars_emitted = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; return the new text that is safe to stream (may be "")."""
        self.ids.extend(token_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.num_chars_emitted += len(delta)
        return delta

    def finish(self) -> str:
        """The text not yet streamed, so that all chunks joined equal decode(ids)."""
        full = self._decode(self.ids)
        rest = full[self.num_chars_emitted :]
        self.num_chars_emitted = len(full)
        return rest
