"""Stop strings across token boundaries, with held-back text never streamed."""

import pytest

from router.stop_strings import StopStringMatcher


def run(stop, pieces):
    m = StopStringMatcher(tuple(stop))
    out = [m.push(p) for p in pieces]
    if m.matched is None:
        out.append(m.flush())
    return out, m.matched


def test_match_split_across_pieces_is_cut_and_never_streamed():
    out, matched = run(["END"], ["The cat E", "N", "D and more"])
    assert "".join(out) == "The cat " and matched == "END"
    assert out == ["The cat ", "", ""]  # "E" and "N" were held back, then dropped


def test_false_start_is_released_once_it_cannot_match():
    out, matched = run(["END"], ["an E", "x", "it"])
    assert "".join(out) == "an Exit" and matched is None
    assert out[0] == "an " and out[1] == "Ex"


def test_earliest_of_several_stop_strings_wins():
    out, matched = run(["world", "lo"], ["hello world"])
    assert "".join(out) == "hel" and matched == "lo"


def test_held_text_is_flushed_at_the_end():
    out, matched = run(["###"], ["abc#", "#"])
    assert "".join(out) == "abc##" and matched is None


@pytest.mark.parametrize("text", ["no stops here", "ünïcödé → 東京"])
def test_no_stop_strings_passes_everything_through(text):
    out, _ = run([], [text[:3], text[3:]])
    assert "".join(out) == text
