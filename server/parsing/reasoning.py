"""Reasoning parser for `<think>…</think>` (Qwen3, DeepSeek-R1 family, DeepSeek-V3.1 thinking)."""
from __future__ import annotations

from typing import Literal

from server.parsing.segments import TrimmedText
from server.parsing.tags import Tag, TagSplitter

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

Channel = Literal["reasoning", "content"]
ChannelText = tuple[Channel, str]


class ThinkReasoningParser:
    """Splits the output into reasoning and answer text.

    `starts_in_reasoning`: the generation prompt already opened the block (R1's `<think>⏎`, V3.1's `<think>`), so
    the output starts inside reasoning and only `</think>` matters. Otherwise reasoning exists only when the output
    opens with `<think>` (Qwen3). A `<think>` before any reasoning text is accepted either way (R1-0528 writes it
    itself). Reasoning loses its edge newlines and the answer its leading newlines, as the templates re-render them
    (`trims`; Kimi's template writes both verbatim, so nothing is trimmed). Output that ends inside reasoning
    (truncated) stays reasoning.
    """

    def __init__(self, starts_in_reasoning: bool, tags: tuple[str, str] = (THINK_OPEN, THINK_CLOSE),
                 trims: bool = True):
        self._open, self._close = Tag(tags[0]), Tag(tags[1])  # Gemma 4 thinks in <|channel>thought ... <channel|>
        self._splitter = TagSplitter(tags)
        self._starts_in_reasoning = starts_in_reasoning
        self._state: Literal["undecided", "reasoning", "content"] = "undecided"
        self._pending = ""  # whitespace seen while undecided
        self._edge = "\n" if trims else ""
        self._reasoning = TrimmedText(lead=self._edge, trail=self._edge)
        self._content = TrimmedText()

    def feed(self, text: str) -> list[ChannelText]:
        return self._handle(self._splitter.feed(text))

    def finish(self) -> list[ChannelText]:
        out = self._handle(self._splitter.finish())
        if self._state == "undecided" and self._pending:
            out += [(channel, text) for channel, text in self._decide(self._pending) if text]
        self._reasoning.take_held()  # trailing newlines of unterminated reasoning are dropped like terminated ones
        return out

    def _handle(self, pieces: list[str | Tag]) -> list[ChannelText]:
        out: list[ChannelText] = []
        for piece in pieces:
            if self._state == "undecided":
                out += self._undecided(piece)
            elif self._state == "reasoning":
                if piece == self._close:
                    self._end_reasoning()
                else:
                    out.append(("reasoning", self._reasoning.push(_text(piece))))
            else:
                out.append(("content", self._content.push(_text(piece))))
        return [(channel, text) for channel, text in out if text]

    def _undecided(self, piece: str | Tag) -> list[ChannelText]:
        if isinstance(piece, str) and piece.isspace():
            self._pending += piece
            return []
        if piece == self._open:
            self._pending = ""
            self._state = "reasoning"
            return []
        if piece == self._close and self._starts_in_reasoning:
            self._pending = ""
            self._end_reasoning()
            return []
        return self._decide(self._pending + _text(piece))

    def _decide(self, text: str) -> list[ChannelText]:
        self._pending = ""
        if self._starts_in_reasoning:
            self._state = "reasoning"
            return [("reasoning", self._reasoning.push(text))]
        self._state = "content"
        return [("content", self._content.push(text))]

    def _end_reasoning(self) -> None:
        self._reasoning.take_held()
        self._state = "content"
        self._content = TrimmedText(lead=self._edge)


def _text(piece: str | Tag) -> str:
    return piece.text if isinstance(piece, Tag) else piece
