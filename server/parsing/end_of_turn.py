"""Cuts the output at the first end-of-turn token: the server detokenizes with special tokens kept."""
from __future__ import annotations

from server.parsing.tags import Tag, TagSplitter

END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<｜end▁of▁sentence｜>")


class EndOfTurnStripper:
    """Passes text through until an end-of-turn token; the token and anything after it are not part of the reply.
    `dropped`: markup that is not part of it either but does not end it (Kimi-K3's response channel tags)."""

    def __init__(self, tokens: tuple[str, ...] = END_OF_TURN_TOKENS, dropped: tuple[str, ...] = ()):
        self._splitter = TagSplitter(tokens + dropped)
        self._dropped = {Tag(tag) for tag in dropped}
        self._ended = False

    def feed(self, text: str) -> str:
        return self._take(self._splitter.feed(text))

    def finish(self) -> str:
        return self._take(self._splitter.finish())

    def _take(self, pieces: list[str | Tag]) -> str:
        out = []
        for piece in pieces:
            if self._ended:
                break
            if piece in self._dropped:
                continue
            if isinstance(piece, Tag):
                self._ended = True
            else:
                out.append(piece)
        return "".join(out)
