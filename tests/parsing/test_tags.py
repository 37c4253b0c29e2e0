from hypothesis import given
from hypothesis import strategies as st

import pytest

from server.parsing.segments import TrimmedText
from server.parsing.tags import Tag, TagSplitter

TAGS = ("<tool_call>", "</tool_call>", "<think>")


def _split_all(splitter: TagSplitter, chunks: list[str]) -> list:
    pieces = []
    for chunk in chunks:
        pieces += splitter.feed(chunk)
    pieces += splitter.finish()
    merged: list = []  # text pieces may be cut anywhere; only their concatenation between tags is defined
    for piece in pieces:
        if isinstance(piece, str) and merged and isinstance(merged[-1], str):
            merged[-1] += piece
        else:
            merged.append(piece)
    return merged


def test_splits_on_tags_and_keeps_text_between():
    assert _split_all(TagSplitter(TAGS), ["a<tool_call>b</tool_call><think>"]) == [
        "a",
        Tag("<tool_call>"),
        "b",
        Tag("</tool_call>"),
        Tag("<think>"),
    ]


def test_holds_back_a_possible_partial_tag_only():
    splitter = TagSplitter(TAGS)
    assert splitter.feed("hello <tool_") == ["hello "]
    assert splitter.feed("x") == ["<tool_x"]
    assert splitter.feed("<") == []
    assert splitter.finish() == ["<"]


def test_rejects_a_tag_that_prefixes_another():
    with pytest.raises(ValueError):
        TagSplitter(("<a>", "<a>b"))


@given(st.lists(st.sampled_from(["<tool_call>", "</tool_call>", "<think>", "<", "</", "tool", "_call>", "x", "\n"])),
       st.lists(st.integers(min_value=0, max_value=200)))
def test_same_pieces_however_split(parts, cuts):
    text = "".join(parts)
    bounds = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    assert _split_all(TagSplitter(TAGS), chunks) == _split_all(TagSplitter(TAGS), [text])


def test_trimmed_text_drops_leading_and_holds_trailing():
    run = TrimmedText(lead="\n", trail="\n ")
    assert run.push("\n\n") == ""
    assert run.push("\nab \n") == "ab"
    assert run.push("c\n") == " \nc"
    assert run.take_held() == "\n"
