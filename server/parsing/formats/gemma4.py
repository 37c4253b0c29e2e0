"""Gemma 4's tool calls: `<|tool_call>call:NAME{key:value,...}<tool_call|>`, as its chat template writes them
(server/rendering/native/gemma4.py). Values are in Gemma's notation, not JSON: strings between `<|"|>` quotes (raw
text inside: code, newlines and `<tool_call|>` included), `true`/`false`, numbers written bare, objects with bare keys
and lists. A bare value carries no type of its own, so a top-level one is typed by the tool's schema
(`param_types.coerce_parameter`: `5` is 5 for an integer parameter, "5" for a string one); without a schema, and
inside objects and lists, it reads as a JSON literal where it is one (`None`, which the template writes for null,
too), else as text. Arguments are re-serialised as JSON and stream per completed pair: `{"a": 1`, then `, "b": "x"`,
then `}` when the call ends. A repeated key keeps its first value; text that breaks the notation ends the arguments.
"""
from __future__ import annotations

import json
import re

from server.parsing.deltas import ParsedCall
from server.parsing.formats.gemma4_grammar import arguments_format
from server.parsing.param_types import coerce_parameter, schema_types, tool_properties

CALL_OPEN, CALL_CLOSE = "<|tool_call>", "<tool_call|>"
from server.rendering.native.gemma4 import QUOTE  # the notation's quote, one token in Gemma 4's vocabulary
_HEAD = "call:"
_NAME = re.compile(r"[\w.\-]+")
_MAX_NAME = 256
_LAYOUT = " \t\r\n"
_LITERALS = {"true": True, "false": False, "null": None, "None": None}


class Gemma4Format:
    call_open = CALL_OPEN
    call_close = CALL_CLOSE
    block_open = None
    block_close = None
    calls_prefix = ""
    trims_around_calls = True  # the template trims a model turn's text and writes calls back to back
    call_separator = ""
    argument_style = "gemma4"

    def __init__(self, tools: list[dict] | None):
        self._properties = tool_properties(tools)
        self._open: Gemma4CallParser | None = None  # the call being read (the stream reads one at a time)

    def new_call(self) -> Gemma4CallParser:
        self._open = Gemma4CallParser(self._properties)
        return self._open

    def body_is_open(self, body: str) -> bool:
        # Inside a quoted string, `<tool_call|>` is text
        return self._open is not None and self._open.in_string

    def call_tag(self, name: str) -> tuple[str, str]:
        return f"{CALL_OPEN}{_HEAD}{name}", CALL_CLOSE

    def arguments_format(self, schema: dict) -> dict:
        """For constrained decoding: the arguments in Gemma's notation (server/parsing/formats/gemma4_grammar.py)."""
        return arguments_format(schema)


class Gemma4CallParser:
    """Reads one call body as it grows, each character once: `call:NAME{`, then `key:value` pairs."""

    def __init__(self, properties: dict[str, dict]):
        self._all_properties = properties
        self._properties: dict[str, dict] = {}
        self._name: str | None = None
        self._phase = "key"  # reading a "key" or a "value"; "done" once the object closes or the notation breaks
        self._start = 0  # where the open key or value starts
        self._position = 0  # scanned up to here
        self._depth = 0  # brackets open inside the value
        self._in_string = False
        self._key = ""
        self._keys: list[str] = []

    @property
    def name(self) -> str | None:
        return self._name

    @property
    def in_string(self) -> bool:
        return self._in_string

    def update(self, body: str) -> str:
        if self._name is None:
            brace = body.find("{")
            if brace < 0 or (name := _call_name(body[:brace])) is None:
                return ""
            self._name, self._start = name, brace + 1
            self._position = self._start
            self._properties = self._all_properties.get(name, {})
        fragments = []
        while self._phase != "done" and (fragment := self._step(body)) is not None:
            fragments.append(fragment)
        return "".join(fragments)

    def complete(self, body: str) -> bool:
        if self._name is None:
            return False
        return self._phase == "done" or (self._phase == "key" and not body[self._start:].strip(_LAYOUT))

    def could_be_call(self, body: str) -> bool:
        head = body.lstrip(_LAYOUT)
        if len(head) <= len(_HEAD):
            return _HEAD.startswith(head)
        if not head.startswith(_HEAD):
            return False
        name = head[len(_HEAD):].partition("{")[0]
        return len(name) <= _MAX_NAME and (not name or _NAME.fullmatch(name) is not None)

    def close(self, body: str) -> ParsedCall | None:
        if self._name is None:
            return None
        return ParsedCall(self._name, "}" if self._keys else "{}")

    def _step(self, body: str) -> str | None:
        """Scans to the end of the open key or value: the argument text it adds, or None when more text is needed."""
        i = self._position
        while i < len(body):
            if body.startswith(QUOTE, i):
                self._in_string = not self._in_string
                i += len(QUOTE)
                continue
            if QUOTE.startswith(body[i:]) and body[i] == "<":  # a quote may be arriving: wait for it
                break
            char = body[i]
            i += 1
            if self._in_string:
                continue
            if self._phase == "key":
                if char == ":":
                    self._key, self._phase, self._start = body[self._start:i - 1].strip(_LAYOUT), "value", i
                    self._position = i
                    return ""
                if char == "}" and not body[self._start:i - 1].strip(_LAYOUT):
                    self._phase = "done"  # `{}`, or a comma before the closing brace
                    return ""
                if char in "{}[],":
                    self._phase = "done"  # a key cannot hold these: the notation broke
                    return ""
                continue
            if char in "{[":
                self._depth += 1
            elif char in "}]" and self._depth:
                self._depth -= 1
            elif char in ",}" and not self._depth:
                raw = body[self._start:i - 1]
                self._phase, self._start, self._position = ("key" if char == "," else "done"), i, i
                return self._pair(self._key, raw)
        self._position = i
        return None

    def _pair(self, key: str, raw: str) -> str:
        """One `"key": value` member of the arguments, or '' for a repeated key."""
        if key in self._keys or not key:
            return ""
        value = top_value(raw.strip(_LAYOUT), self._properties.get(key))
        self._keys.append(key)
        lead = "{" if len(self._keys) == 1 else ", "
        return f"{lead}{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"


def top_value(raw: str, schema: dict | None) -> object:
    """A parameter's value: a bare one typed by its schema, anything else read in Gemma's notation."""
    if raw and raw[0] not in "{[" and not raw.startswith(QUOTE) and schema_types(schema):
        return coerce_parameter(raw, schema)
    parsed = _Reader(raw).whole()
    return raw if parsed is _BROKEN else parsed


_BROKEN = object()


class _Reader:
    """A recursive reader of one value in Gemma's notation; `_BROKEN` when the text is not one."""

    def __init__(self, text: str):
        self._text = text
        self._at = 0

    def whole(self) -> object:
        try:
            value = self._value()
        except ValueError:
            return _BROKEN
        return value if self._at == len(self._text) else _BROKEN

    def _value(self) -> object:
        text = self._text
        if text.startswith(QUOTE, self._at):
            end = text.find(QUOTE, self._at + len(QUOTE))
            if end < 0:
                raise ValueError("open string")
            value, self._at = text[self._at + len(QUOTE):end], end + len(QUOTE)
            return value
        if text.startswith("{", self._at):
            return dict(self._members("}", keyed=True))
        if text.startswith("[", self._at):
            return [value for _, value in self._members("]", keyed=False)]
        end = self._at
        while end < len(text) and text[end] not in ",}]":
            end += 1
        bare, self._at = text[self._at:end].strip(_LAYOUT), end
        return _literal(bare)

    def _members(self, closer: str, keyed: bool) -> list[tuple[str, object]]:
        self._at += 1
        out: list[tuple[str, object]] = []
        while True:
            if self._text.startswith(closer, self._at):
                self._at += 1
                return out
            key = ""
            if keyed:
                if self._text.startswith(QUOTE, self._at):
                    key = self._value()
                    colon = self._text.find(":", self._at)
                else:
                    colon = self._text.find(":", self._at)
                    key = self._text[self._at:colon].strip(_LAYOUT)
                if colon < 0:
                    raise ValueError("no colon")
                self._at = colon + 1
            out.append((str(key), self._value()))
            if self._text.startswith(",", self._at):
                self._at += 1
            elif not self._text.startswith(closer, self._at):
                raise ValueError("unclosed")


def _literal(bare: str) -> object:
    if bare in _LITERALS:
        return _LITERALS[bare]
    try:
        number = json.loads(bare)
    except ValueError:
        return bare
    return number if isinstance(number, (int, float)) else bare


def _call_name(head: str) -> str | None:
    """The function name of `call:NAME` (the body before its `{`), or None if it is not one."""
    head = head.lstrip(_LAYOUT)
    if not head.startswith(_HEAD) or len(head) > _MAX_NAME + len(_HEAD):
        return None
    name = head[len(_HEAD):]
    return name if _NAME.fullmatch(name) else None
