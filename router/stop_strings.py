"""Stop strings, matched on the detokenized text across token boundaries.

``StopStringMatcher.push(delta)`` takes each new piece of text and returns what may be
streamed now. Text that could still turn out to be the start of a stop string (a suffix
of the text so far that is a prefix of some stop string) is held back; once a stop
string appears, the text before it is released, ``matched`` is set, and nothing after
it ever is. The stop string itself is never returned (as in vLLM and OpenAI).
"""

from __future__ import annotations


class StopStringMatcher:
    def __init__(self, stop: tuple[str, ...]):
        self.stop = tuple(s for s in stop if s)
        self.max_len = max((len(s) for s in self.stop), default=0)
        self.pending = ""  # held back: may be the start of a stop string
        self.matched: str | None = None

    def push(self, delta: str) -> str:
        """Returns the text that is safe to stream after adding ``delta`` ("" if none)."""
        if self.matched is not None:
            return ""
        if not self.stop:
            return delta
        text = self.pending + delta
        hits = [(text.find(s), s) for s in self.stop if s in text]
        if hits:
            index, self.matched = min(hits)
            self.pending = ""
            return text[:index]
        keep = self._held_suffix(text)
        self.pending = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """At the end of generation without a match: the held-back text."""
        out, self.pending = ("" if self.matched is not None else self.pending), ""
        return out

    def _held_suffix(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        for n in range(min(len(text), self.max_len - 1), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0
