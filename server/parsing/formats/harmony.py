"""gpt-oss' output in the harmony format, parsed as it streams: reasoning, answer text and tool calls.

After the generation prompt ``<|start|>assistant`` the model writes messages, each a header, ``<|message|>``, a body
and an end: ``<|end|>`` (another message follows, opened by ``<|start|>assistant``), ``<|call|>`` (a tool call, the
end of the turn) or ``<|return|>`` (the answer, the end of the turn). The header names the channel
(``<|channel|>analysis``, ``final`` or ``commentary``) and, for a call, its recipient ``to=functions.NAME`` (before or
after the channel: the model writes it after, the rendered history before) with the content type
(``<|constrain|>json``). So:

- ``analysis`` bodies are reasoning;
- ``final`` bodies, and ``commentary`` bodies without a recipient (a preamble to the user), are answer text;
- a body addressed to ``functions.NAME`` is a call to NAME whose arguments are the body: announced when its header
  ends, its arguments streamed as written (or, without streaming, reported once whole). A call the output cuts off is
  closed into valid JSON when it has streamed, dropped when it has not (`server.parsing.tool_stream`'s rules).
  Without tool parsing (no tools, ``tool_choice: none``) a call's body is answer text.

Headers are held until ``<|message|>``; markers are recognised whole however the text is split (`TagSplitter`), so
the deltas are the same for any split. Text outside a message (between ``<|end|>`` and ``<|start|>``) is dropped;
output that never opens a message (no marker before the output or the message ends) is answer text.
"""
from __future__ import annotations

import re
from typing import Literal

from server.parsing.deltas import Delta
from server.parsing.json_closer import closing_suffix
from server.parsing.stream import OutputParser
from server.parsing.tags import Tag, TagSplitter
from server.parsing.tool_stream import CallArguments, CallStart

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
# The model's turn is over at these (the last two end the output too: they are stop tokens)
TURN_ENDS = (CALL, RETURN, "<|endoftext|>")
_MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, END) + TURN_ENDS
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
FUNCTIONS = "functions."
# The markers' ids in o200k_harmony, the one vocabulary of harmony models: a grammar names special tokens by id (the
# engine's grammar vocabulary leaves control tokens' text out, so no text can produce them)
TOKEN_IDS = {CHANNEL: 200005, CONSTRAIN: 200003, MESSAGE: 200008, CALL: 200012}

Body = Literal["reasoning", "text", "call"]


def read_header(header: str) -> tuple[str, str | None]:
    """``(channel, recipient)`` of a message header (``assistant<|channel|>commentary to=functions.f <|constrain|>json``:
    ``("commentary", "functions.f")``); the channel is ``final`` when the header names none."""
    channel = "final"
    if CHANNEL in header:
        after = header.split(CHANNEL, 1)[1].split(CONSTRAIN, 1)[0].strip()
        channel = after.split()[0] if after.split() else "final"
    found = _RECIPIENT.search(header.replace(CHANNEL, " ").replace(CONSTRAIN, " "))
    return channel, found.group(1) if found else None


class HarmonyOutputParser(OutputParser):
    """`OutputParser`'s contract (deltas, items, ``limited``, split invariance) for harmony output. ``parse_calls``:
    calls become tool calls (else their bodies are text)."""

    def __init__(self, *, parse_calls: bool, id_prefix: str, streaming: bool = True, max_calls: int | None = None):
        super().__init__(tool_format=None, reasoning=None, id_prefix=id_prefix, streaming=streaming,
                         max_calls=max_calls)
        self._splitter = TagSplitter(_MARKERS)
        self._parse_calls, self._streaming = parse_calls, streaming
        self._state: Literal["header", "body", "between", "done"] = "header"  # the prompt opened the first message
        self._header: list[str] = []
        self._body: Body = "text"
        self._call_name = ""
        self._arguments: list[str] = []  # the current call's arguments so far

    def _run(self, text: str, final: bool, cut: bool = False) -> list[Delta]:
        pieces = self._splitter.feed(text) + (self._splitter.finish() if final else [])
        deltas: list[Delta] = []
        for piece in pieces:
            if self._state == "done" or self.limited:
                break
            deltas += self._tag(piece.text) if isinstance(piece, Tag) else self._text(piece)
        if final and self._state == "body" and self._body == "call":
            deltas += self._end_call(cut)
        if final and self._state == "header":
            deltas += self._unframed_text()
        if self.limited:
            self._finished = True
        return deltas

    def _text(self, text: str) -> list[Delta]:
        if self._state == "header":
            self._header.append(text)
            return []
        if self._state != "body":
            return []  # between messages: not part of any
        if self._body == "reasoning":
            return self._add("reasoning", text)
        if self._body == "text":
            return self._add("text", text)
        self._arguments.append(text)
        return self._tool_deltas([CallArguments(text)]) if self._streaming else []

    def _tag(self, tag: str) -> list[Delta]:
        deltas: list[Delta] = []
        if self._state == "header":
            if tag == MESSAGE:
                return self._open_body()
            if tag in (CHANNEL, CONSTRAIN):
                self._header.append(tag)
                return []
            deltas = self._unframed_text()
        elif self._state == "body" and tag in (CHANNEL, MESSAGE, CONSTRAIN):
            return self._text(tag)  # a marker inside a body is its text (a message about the format)
        if self._state == "body" and self._body == "call":
            deltas = self._end_call(cut=False)
        if tag == START:
            self._state, self._header = "header", []
        elif tag in TURN_ENDS:
            self._state = "done"
        else:  # <|end|>, or a stray marker between messages
            self._state = "between"
        return deltas

    def _unframed_text(self) -> list[Delta]:
        """A "header" that never became one (no marker in it, and the output or the message ends): text the model
        wrote outside the format, kept as answer text rather than lost."""
        header, self._header = "".join(self._header), []
        return self._add("text", header) if header and CHANNEL not in header and CONSTRAIN not in header else []

    def _open_body(self) -> list[Delta]:
        channel, recipient = read_header("".join(self._header))
        self._state, self._header = "body", []
        if recipient is not None and self._parse_calls:
            self._body, self._arguments = "call", []
            self._call_name = recipient.removeprefix(FUNCTIONS)
            return self._tool_deltas([CallStart(self._call_name)]) if self._streaming else []
        self._body = "reasoning" if channel == "analysis" else "text"
        return []

    def _end_call(self, cut: bool) -> list[Delta]:
        """The call ends here: streamed, its JSON closed if the output cut it; held, reported whole (or dropped when
        cut off)."""
        self._body = "text"
        arguments = "".join(self._arguments)
        if self._streaming:
            suffix = closing_suffix(arguments) if arguments.strip() else "{}"
            return self._tool_deltas([CallArguments(suffix)]) if suffix else []
        if cut:
            return []
        return self._tool_deltas([CallStart(self._call_name), CallArguments(arguments)])


class HarmonyFormat:
    """A call as the model writes it, for the grammars that guarantee calls (server/parsing/call_grammar.py):
    ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGS<|call|>`` right after the generation
    prompt's ``<|start|>assistant``, its markers the special tokens themselves (xgrammar's token formats, by their
    o200k_harmony ids), not their text spelled in ordinary tokens. ``<|call|>`` ends the turn, so a turn holds one call. With ``tool_choice`` auto
    there is no grammar (a call opens with special tokens, which no text trigger sees). `HarmonyOutputParser` reads
    the output."""

    call_open: str | None = None
    call_close = CALL
    block_open: str | None = None
    block_close: str | None = None
    trims_around_calls = False
    call_separator = f"{START}assistant"
    argument_style: Literal["json"] = "json"
    calls_prefix = ""
    one_call_per_turn = True  # <|call|> ends the turn (server/parsing/call_grammar.py)

    def call_tag(self, name: str) -> tuple[str, str]:
        """The call's text around its arguments (what the parser reads)."""
        return f"{CHANNEL}commentary to={FUNCTIONS}{name} {CONSTRAIN}json{MESSAGE}", CALL

    def call_format(self, name: str, arguments: dict) -> dict:
        """The call as an xgrammar structural-tag format: special tokens as tokens, the arguments ``arguments``."""
        token = lambda marker: {"type": "token", "token": TOKEN_IDS[marker]}  # noqa: E731
        return {"type": "sequence", "elements": [
            token(CHANNEL), {"type": "const_string", "value": f"commentary to={FUNCTIONS}{name} "}, token(CONSTRAIN),
            {"type": "const_string", "value": "json"}, token(MESSAGE), arguments, token(CALL)]}
