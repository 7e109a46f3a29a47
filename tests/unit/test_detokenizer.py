"""Streaming detokenization with the real tokenizer: valid chunks that join to decode(ids)."""

import pytest

from pdserve.detokenizer import IncrementalDetokenizer
from pdserve.model_loader import load_tokenizer

TEXTS = [
    "The capital of France is Paris.",
    "Zürich, München, Kraków — naïve café; 東京は日本の首都です。 Emoji: 🚀🎉👩‍👩‍👧 done",
    "  leading spaces\n\nand\ttabs  ",
]


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_chunks_join_to_decode(real_model_dir, text):
    tokenizer = load_tokenizer(real_model_dir)
    ids = tokenizer(text).input_ids
    detok = IncrementalDetokenizer(tokenizer)
    chunks = [detok.add([i]) for i in ids]
    chunks.append(detok.finish())
    assert all("\ufffd" not in c for c in chunks)
    assert "".join(chunks) == tokenizer.decode(ids, skip_special_tokens=True)


def test_a_character_split_across_tokens_is_held_back(real_model_dir):
    tokenizer = load_tokenizer(real_model_dir)
    ids = tokenizer("🚀").input_ids
    assert len(ids) > 1, "this check needs a character that spans several tokens"
    detok = IncrementalDetokenizer(tokenizer)
    chunks = [detok.add([i]) for i in ids]
    assert chunks[:-1] == [""] * (len(ids) - 1) and chunks[-1] == "🚀"
