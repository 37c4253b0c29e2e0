"""The tool-call state machine shared by every format: text, optional call blocks, and calls that stream.

A call is announced (`CallStart`) as soon as its format's `CallParser` has read the function name and the start of
the arguments, and its argument text follows (`CallArguments`) as the model writes it. Until then the call is held
back, because a call that turns out malformed must become content again: its markup (and the whitespace trimmed
before it) is kept in `_raw`, and when it closes the parser may still accept it whole (one arguments fragment).

Late-malformed calls: OpenAI clients cannot retract a delta, so a call that has started streaming stays a call
whatever follows. It ends at its closing tag, at the next call's opening (once its arguments are complete), or at
the end of the stream; its arguments are the text streamed so far, closed into valid JSON when the output cut them
off (`json_closer`), and any text in the call after its arguments is markup, not content. Without streaming
(`streaming=False`), a call is reported only once it is whole. A call the output cuts off (`finish(cut=True)`: the
token limit, not the model, ended the output) never becomes content: held back, it is dropped with its markup, and
so is a partial tag at the very end (`<too`); the calls completed before it stay.

Markup that is not a call: a call opening whose body can no longer become a call (`<tool_call>` in prose) is content
as soon as that shows, so a real call after it is still found; inside a markdown code fence call tags are text.
Everything here depends only on the text, never on how it was split.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

from server.parsing.deltas import ParsedCall
from server.parsing.jsonargs import is_json_object
from server.parsing.segments import WHITESPACE, CodeFences, TrimmedText
from server.parsing.tags import Tag, TagSplitter


@dataclass(frozen=True)
class CallStart:
    name: str
    call_id: str = ""  # the model's own id for the call, when its format writes one (Kimi)


@dataclass(frozen=True)
class CallArguments:
    """More argument text of the call started last."""

    text: str


ToolEvent = str | CallStart | CallArguments  # text is answer content


class CallParser(Protocol):
    """Reads one call's body (the text between the call tags) as it grows."""

    @property
    def name(self) -> str | None:
        """The function name once the call streams; None while it is held back."""

    def update(self, body: str) -> str:
        """`body` is the whole body so far (it only grows); returns the argument text it adds, '' while held."""

    def complete(self, body: str) -> bool:
        """True when the call's arguments are finished, so a call tag here ends the call rather than being text."""

    def could_be_call(self, body: str) -> bool:
        """While held back: False once `body` cannot be the start of a call."""

    def close(self, body: str) -> ParsedCall | None:
        """The call ends here. Streaming: the name and the argument text not yet returned (closing the JSON when it
        is unfinished). Held back: the whole call, or None when the body is not a call. A held-back body may hold
        further calls (Mistral's older `[TOOL_CALLS][{…}, {…}]` list): a parser that reads such bodies also has
        `more_calls(body)`, the calls after the first."""


class ToolFormat(Protocol):
    """How one family writes tool calls. Calls open with `call_open` and close with `call_close`; DeepSeek also wraps
    a run of calls in `block_open`/`block_close`."""

    call_open: str
    call_close: str
    block_open: str | None
    block_close: str | None
    # Qwen templates put their own whitespace around calls, so the model's is not content; DeepSeek's concatenate.
    trims_around_calls: bool
    # For constrained decoding (server/parsing/call_grammar.py): what the template writes between two calls (inside
    # the block, for DeepSeek), and how arguments are written.
    call_separator: str
    argument_style: Literal["json", "qwen_xml", "deepseek_xml", "glm_xml", "gemma4"]
    # What the template writes before a turn's calls when the turn has no text (DSML: a blank line).
    calls_prefix: str

    def new_call(self) -> CallParser:
        """A parser for the body of one call."""

    def call_tag(self, name: str) -> tuple[str, str]:
        """The exact text before and after the arguments of a call to `name`, as the template renders it."""

    def body_is_open(self, body: str) -> bool:
        """True when the body is an unfinished call, so a closing tag here is part of a value (a string that
        mentions `</tool_call>`), not the end of the call."""

    def block_tag(self) -> tuple[str, str]:
        """With a block: the exact text around its calls, as the template renders it (starting with `block_open`)."""


class PlainContent:
    """Used when nothing may be parsed as a call: everything is content."""

    def feed(self, text: str) -> list[ToolEvent]:
        return [text] if text else []

    def finish(self, cut: bool = False) -> list[ToolEvent]:
        return []


class ToolCallStream:
    """Feeds answer text, yields content text, call starts and argument fragments."""

    def __init__(self, fmt: ToolFormat, streaming: bool = True):
        self._fmt = fmt
        self._streaming = streaming
        tags = [fmt.call_open, fmt.call_close]
        if fmt.block_open and fmt.block_close:
            tags += [fmt.block_open, fmt.block_close]
        self._splitter = TagSplitter(tags)
        self._fences = CodeFences()
        self._state: Literal["text", "block", "call"] = "text"
        self._in_block = False
        self._calls_in_block = 0
        self._raw = ""
        self._body = ""
        self._call = fmt.new_call()
        self._call_events: list[ToolEvent] = []  # without streaming: the open call's events, out once it is whole
        self._text = self._new_segment(after_call=False)

    def feed(self, text: str) -> list[ToolEvent]:
        return self._handle(self._splitter.feed(text))

    def finish(self, cut: bool = False) -> list[ToolEvent]:
        """``cut``: the output was cut off, so unfinished markup at its end is dropped, not made content."""
        held = self._splitter.finish()  # the start of a tag, if any
        out = self._handle([] if cut else held)
        if self._state == "call":  # the output ended inside a call
            if self._call.complete(self._body) or (self._streaming and self._call.name is not None):
                self._end_or_abandon_call(out)
            elif not cut:
                out.append(self._text.push(self._raw + self._body))
        elif self._state == "block" and not self._calls_in_block and not cut:
            out.append(self._text.push(self._raw))
        out.append(self._text.take_held())
        return [event for event in out if event != ""]

    def _new_segment(self, after_call: bool) -> TrimmedText:
        trim = WHITESPACE if self._fmt.trims_around_calls else ""
        return TrimmedText(lead=trim if after_call else "", trail=trim)

    def _handle(self, pieces: list[str | Tag]) -> list[ToolEvent]:
        out: list[ToolEvent] = []
        for piece in pieces:
            self._dispatch(piece, out)
        return [event for event in out if event != ""]

    def _dispatch(self, piece: str | Tag, out: list[ToolEvent]) -> None:
        if self._state == "text":
            self._on_text(piece, out)
        elif self._state == "block":
            self._on_block(piece, out)
        else:
            self._on_call(piece, out)

    def _on_text(self, piece: str | Tag, out: list[ToolEvent]) -> None:
        fmt = self._fmt
        if piece == Tag(fmt.call_open) and not self._fences.inside:
            self._open_call(self._text.take_held() + fmt.call_open, in_block=False)
        elif fmt.block_open and piece == Tag(fmt.block_open) and not self._fences.inside:
            self._raw = self._text.take_held() + fmt.block_open
            self._state, self._in_block, self._calls_in_block = "block", True, 0
        else:
            self._fences.feed(_text(piece))
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
        complete = isinstance(piece, Tag) and self._call.complete(self._body)
        if piece == Tag(fmt.call_close) and (complete or not fmt.body_is_open(self._body)):
            if not self._end_call(out):
                self._abandon_call(self._body + fmt.call_close, out)
            elif self._in_block:
                self._state = "block"
            else:
                self._leave_calls(after_call=True)
        elif complete and piece == Tag(fmt.call_open):
            self._end_or_abandon_call(out)  # the model forgot the closing tag before starting the next call
            self._open_call(fmt.call_open, in_block=self._in_block)
        elif complete and self._in_block and piece == Tag(fmt.block_close):
            self._end_or_abandon_call(out)
            self._leave_calls(after_call=True)
        elif self._call.name is None and not self._call.could_be_call(self._body + _text(piece)):
            self._abandon_call(self._body, out)  # the opening tag was text: what follows is read afresh
            self._dispatch(piece, out)
        else:
            self._body += _text(piece)
            streaming = self._call.name is not None
            fragment = self._call.update(self._body)
            if not streaming and self._call.name is not None:
                self._start_call(self._call.name, out, getattr(self._call, "call_id", ""))
            if fragment:
                self._emit(CallArguments(fragment), out)

    def _open_call(self, raw: str, in_block: bool) -> None:
        self._raw, self._body, self._call = raw, "", self._fmt.new_call()
        self._state, self._in_block = "call", in_block

    def _abandon_call(self, body: str, out: list[ToolEvent]) -> None:
        """The open call is not one: its markup and body are content (and, outside a block, what the code-fence
        tracker reads, as any content is: a fence opened right after it must be seen however the stream was split)."""
        if not self._in_block:
            self._fences.feed(self._raw + body)
        out.append(self._text.push(self._raw + body))
        self._raw = ""
        self._state = "block" if self._in_block else "text"

    def _start_call(self, name: str, out: list[ToolEvent], call_id: str = "") -> None:
        self._emit(CallStart(name, call_id), out)
        if self._streaming:
            self._calls_in_block += 1
            self._raw = ""  # a started call never becomes content again

    def _emit(self, event: ToolEvent, out: list[ToolEvent]) -> None:
        (out if self._streaming else self._call_events).append(event)

    def _end_call(self, out: list[ToolEvent]) -> bool:
        """Emits what is left of the call in `_body`; False when it is not a call (nothing was emitted). Without
        streaming, a call whose arguments are not a JSON object is not one either."""
        streaming = self._call.name is not None
        call = self._call.close(self._body)
        if call is None:
            return False
        more = getattr(self._call, "more_calls", None)
        calls = [call] if streaming or more is None else [call, *more(self._body)]
        for n, each in enumerate(calls):
            if n or not streaming:
                self._start_call(each.name, out, each.call_id)
            if each.arguments:
                self._emit(CallArguments(each.arguments), out)
        if not self._streaming:
            events, self._call_events = self._call_events, []
            if not all(is_json_object(arguments) for arguments in _arguments_per_call(events)):
                return False
            out += events
            self._calls_in_block += len(calls)
            self._raw = ""
        return True

    def _end_or_abandon_call(self, out: list[ToolEvent]) -> None:
        if not self._end_call(out):
            self._abandon_call(self._body, out)

    def _leave_calls(self, after_call: bool) -> None:
        self._raw = ""
        self._state, self._in_block = "text", False
        if after_call:
            self._text = self._new_segment(after_call=True)


def _arguments_per_call(events: list[ToolEvent]) -> list[str]:
    """The argument text of each call the events start."""
    calls: list[str] = []
    for event in events:
        if isinstance(event, CallStart):
            calls.append("")
        elif isinstance(event, CallArguments):
            calls[-1] += event.text
    return calls


def _text(piece: str | Tag) -> str:
    return piece.text if isinstance(piece, Tag) else piece
