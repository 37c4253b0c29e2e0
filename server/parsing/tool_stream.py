"""The tool-call state machine shared by every format: text, optional call blocks, calls buffered until they close."""
from __future__ import annotations

from typing import Literal, Protocol

from server.parsing.deltas import ParsedCall
from server.parsing.segments import WHITESPACE, TrimmedText
from server.parsing.tags import Tag, TagSplitter

ToolEvent = str | ParsedCall  # text is answer content


class ToolFormat(Protocol):
    """How one family writes tool calls. Calls open with `call_open` and close with `call_close`; DeepSeek also wraps
    a run of calls in `block_open`/`block_close`."""

    call_open: str
    call_close: str
    block_open: str | None
    block_close: str | None
    # Qwen templates put their own whitespace around calls, so the model's is not content; DeepSeek's concatenate.
    trims_around_calls: bool

    def parse_call(self, body: str) -> ParsedCall | None:
        """The call in the text between the call tags, or None when it is malformed."""

    def call_prefix(self, name: str | None) -> str:
        """Text that starts a call (of function `name`, when given) as the model would write it."""

    def body_is_open(self, body: str) -> bool:
        """True when the body is an unfinished call, so a closing tag here is part of a value (a string that
        mentions `</tool_call>`), not the end of the call."""


class PlainContent:
    """Used when nothing may be parsed as a call: everything is content."""

    def feed(self, text: str) -> list[ToolEvent]:
        return [text] if text else []

    def finish(self) -> list[ToolEvent]:
        return []


class ToolCallStream:
    """Feeds answer text, yields content text and complete calls.

    A call is held back until it closes and parses, because a call that turns out malformed must become content
    again: its markup (and the whitespace trimmed before it) is kept in `_raw` until then. At the end of the stream a
    call that never closed is accepted only when its body already parses as a whole call.
    """

    def __init__(self, fmt: ToolFormat):
        self._fmt = fmt
        tags = [fmt.call_open, fmt.call_close]
        if fmt.block_open and fmt.block_close:
            tags += [fmt.block_open, fmt.block_close]
        self._splitter = TagSplitter(tags)
        self._state: Literal["text", "block", "call"] = "text"
        self._in_block = False
        self._calls_in_block = 0
        self._raw = ""
        self._body = ""
        self._text = self._new_segment(after_call=False)

    def feed(self, text: str) -> list[ToolEvent]:
        return self._handle(self._splitter.feed(text))

    def finish(self) -> list[ToolEvent]:
        out = self._handle(self._splitter.finish())
        if self._state == "call":
            call = self._fmt.parse_call(self._body)
            if call is not None:
                out.append(call)
            else:
                out.append(self._text.push(self._raw + self._body))
        elif self._state == "block" and not self._calls_in_block:
            out.append(self._text.push(self._raw))
        out.append(self._text.take_held())
        return [event for event in out if event != ""]

    def _new_segment(self, after_call: bool) -> TrimmedText:
        trim = WHITESPACE if self._fmt.trims_around_calls else ""
        return TrimmedText(lead=trim if after_call else "", trail=trim)

    def _handle(self, pieces: list[str | Tag]) -> list[ToolEvent]:
        out: list[ToolEvent] = []
        for piece in pieces:
            if self._state == "text":
                self._on_text(piece, out)
            elif self._state == "block":
                self._on_block(piece, out)
            else:
                self._on_call(piece, out)
        return [event for event in out if event != ""]

    def _on_text(self, piece: str | Tag, out: list[ToolEvent]) -> None:
        fmt = self._fmt
        if piece == Tag(fmt.call_open):
            self._open_call(self._text.take_held() + fmt.call_open, in_block=False)
        elif fmt.block_open and piece == Tag(fmt.block_open):
            self._raw = self._text.take_held() + fmt.block_open
            self._state, self._in_block, self._calls_in_block = "block", True, 0
        else:
            out.append(self._text.push(_text(piece)))

    def _on_block(self, piece: str | Tag, out: list[ToolEvent]) -> None:
        fmt = self._fmt
        if isinstance(piece, str):
            # Stray text inside a block is answer text (the block may still hold calls); whitespace at its end stays
            # markup until we see what follows, wherever the stream was split.
            body = piece.rstrip(WHITESPACE)
            if body:
                out.append(self._text.push(self._raw + body))
                self._raw = ""
            self._raw += piece[len(body) :]
        elif piece == Tag(fmt.call_open):
            self._open_call(self._raw + fmt.call_open, in_block=True)
        elif piece == Tag(fmt.block_close):
            if not self._calls_in_block:
                out.append(self._text.push(self._raw + fmt.block_close))
            self._leave_calls(after_call=self._calls_in_block > 0)
        else:
            out.append(self._text.push(self._raw + piece.text))
            self._raw = ""

    def _on_call(self, piece: str | Tag, out: list[ToolEvent]) -> None:
        fmt = self._fmt
        if piece == Tag(fmt.call_close):
            call = fmt.parse_call(self._body)
            if call is None and fmt.body_is_open(self._body):
                self._body += fmt.call_close
                return
            if call is None:
                out.append(self._text.push(self._raw + self._body + fmt.call_close))
                self._raw = ""
                self._state = "block" if self._in_block else "text"
                return
            self._emit(call, out)
            if self._in_block:
                self._state = "block"
            else:
                self._leave_calls(after_call=True)
        elif piece == Tag(fmt.call_open) and (call := fmt.parse_call(self._body)) is not None:
            self._emit(call, out)  # the model forgot the closing tag before starting the next call
            self._open_call(fmt.call_open, in_block=self._in_block)
        elif self._in_block and piece == Tag(fmt.block_close) and (call := fmt.parse_call(self._body)) is not None:
            self._emit(call, out)
            self._leave_calls(after_call=True)
        else:
            self._body += _text(piece)

    def _open_call(self, raw: str, in_block: bool) -> None:
        self._raw, self._body = raw, ""
        self._state, self._in_block = "call", in_block

    def _emit(self, call: ParsedCall, out: list[ToolEvent]) -> None:
        out.append(call)
        self._raw = ""
        self._calls_in_block += 1

    def _leave_calls(self, after_call: bool) -> None:
        self._raw = ""
        self._state, self._in_block = "text", False
        if after_call:
            self._text = self._new_segment(after_call=True)


def _text(piece: str | Tag) -> str:
    return piece.text if isinstance(piece, Tag) else piece
