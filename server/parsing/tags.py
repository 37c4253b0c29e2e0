"""Incremental splitting of a text stream on a fixed set of tags, holding back any suffix that may start a tag."""
from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Tag:
    """A complete tag seen in the stream (kept distinct from text so callers can turn it back into text)."""

    text: str


Piece = str | Tag


class TagSplitter:
    """Turns text deltas into text pieces and `Tag`s.

    Text is released only once it cannot be the start of a tag, so the sequence of tags (and the concatenated text
    between them) is the same however the input is split: the leftmost complete tag always wins.
    """

    def __init__(self, tags: Iterable[str]):
        unique = sorted(set(tags), key=len, reverse=True)
        if not unique or "" in unique:
            raise ValueError("TagSplitter needs non-empty tags")
        # A tag that is a prefix of another would be matched before the longer one could complete.
        for a in unique:
            for b in unique:
                if a != b and b.startswith(a):
                    raise ValueError(f"tag {a!r} is a prefix of tag {b!r}")
        self._pattern = re.compile("|".join(re.escape(t) for t in unique))
        self._partials = {t[:k] for t in unique for k in range(1, len(t))}
        self._longest_partial = max(len(t) for t in unique) - 1
        self._buffer = ""

    def feed(self, text: str) -> list[Piece]:
        self._buffer += text
        pieces: list[Piece] = []
        start = 0
        for match in self._pattern.finditer(self._buffer):
            if match.start() > start:
                pieces.append(self._buffer[start : match.start()])
            pieces.append(Tag(match.group()))
            start = match.end()
        rest = self._buffer[start:]
        keep = self._partial_tag_length(rest)
        if len(rest) > keep:
            pieces.append(rest[: len(rest) - keep])
        self._buffer = rest[len(rest) - keep :]
        return pieces

    def finish(self) -> list[Piece]:
        rest, self._buffer = self._buffer, ""
        return [rest] if rest else []

    def _partial_tag_length(self, text: str) -> int:
        for k in range(min(len(text), self._longest_partial), 0, -1):
            if text[-k:] in self._partials:
                return k
        return 0
