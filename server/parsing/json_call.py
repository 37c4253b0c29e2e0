"""The call parser for formats whose arguments are a JSON object written by the model (Qwen JSON, DeepSeek).

A call streams once its `header` has matched: the function name is read and the arguments object has begun with
`{`. From there the model's own bytes are passed through up to the brace that closes that object (strings and
nesting are tracked so braces inside values do not count); what follows it (the enclosing object's `}`, a code fence)
is never argument text. Calls whose header does not match (name after the arguments, arguments as a string) are held
back and parsed whole by `parse_whole` when they close. A call that ends before its arguments object does (cut off,
or closed early) gets the text that makes them valid JSON.
"""
from __future__ import annotations

from collections.abc import Callable

from server.parsing.deltas import ParsedCall
from server.parsing.json_closer import closing_suffix

# (function name, index of the arguments' opening brace) when a body prefix starts a streamable call, else None.
Header = Callable[[str], tuple[str, int] | None]


class JsonCallParser:
    def __init__(self, header: Header, parse_whole: Callable[[str], ParsedCall | None], opening: str = ""):
        self._header = header
        self._parse_whole = parse_whole
        self._opening = opening  # the first non-blank character of every call body ('' when it is not fixed)
        self._name: str | None = None
        self._arguments_start = 0  # where the arguments object begins in the body, once streaming
        self._position = 0  # the body before this has been read
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._closed = False  # the arguments object is complete

    @property
    def name(self) -> str | None:
        return self._name

    def update(self, body: str) -> str:
        if self._name is None:
            # A header match ends at the arguments' `{`, so it can only appear when a new `{` does.
            found = self._header(body) if "{" in body[self._position :] else None
            if found is None:
                self._position = len(body)
                return ""
            self._name, self._position = found
            self._arguments_start = self._position
        return self._read_arguments(body)

    def complete(self, body: str) -> bool:
        return self._closed if self._name is not None else self._parse_whole(body) is not None

    def could_be_call(self, body: str) -> bool:
        start = body.lstrip()[:1]
        return not self._opening or start in ("", self._opening)

    def close(self, body: str) -> ParsedCall | None:
        if self._name is None:
            return self._parse_whole(body)
        # Every argument character went out as it arrived; an unfinished object still has to be closed.
        unfinished = "" if self._closed else closing_suffix(body[self._arguments_start : self._position])
        return ParsedCall(self._name, unfinished)

    def _read_arguments(self, body: str) -> str:
        start = end = self._position
        while end < len(body) and not self._closed:
            char = body[end]
            end += 1
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char == "{":
                self._depth += 1
            elif char == "}":
                self._depth -= 1
                self._closed = self._depth == 0
        self._position = end
        return body[start:end]
