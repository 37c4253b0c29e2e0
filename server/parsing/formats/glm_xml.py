"""GLM-4.5 / 4.6 / 4.7 tool calls: `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>…</tool_call>`.

The template writes a string value as it is and any other value as JSON (`tojson`), so a value is typed by the tool's
schema (`param_types.coerce_parameter`): a parameter declared an integer reads `3` as 3, one declared a string keeps
`3` as "3"; an undeclared one stays text. The arguments are re-serialised, so they stream per completed pair:
`{"a": 1`, then `, "b": "x"`, then `}` when the call ends. A call streams from the first `<arg_key>` (its name is
whole then); a call without arguments is reported when it closes. Whitespace around the tags is layout (models
trained on GLM-4.5's template put newlines there). A key or value still open when the call ends is dropped, a repeated
key keeps its first value, and text that breaks the format ends the arguments, so they are always valid JSON.
"""
from __future__ import annotations

import json
import re

from server.parsing.deltas import ParsedCall
from server.parsing.formats.qwen_json import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from server.parsing.param_types import coerce_parameter, tool_properties

ARG_KEY_OPEN, ARG_KEY_CLOSE = "<arg_key>", "</arg_key>"
ARG_VALUE_OPEN, ARG_VALUE_CLOSE = "<arg_value>", "</arg_value>"
_MAX_NAME = 256  # longer, or with spaces inside (`<tool_call>` in prose), the body is not a call
_NAME = re.compile(r"\s*([^\s<>]+)\s*")
_LAYOUT = " \t\r\n"


class GlmFormat:
    call_open = TOOL_CALL_OPEN
    call_close = TOOL_CALL_CLOSE
    block_open = None
    block_close = None
    calls_prefix = ""
    trims_around_calls = True  # the template strips the text before the calls and writes them back to back
    call_separator = ""
    argument_style = "glm_xml"

    def __init__(self, tools: list[dict] | None):
        self._properties = tool_properties(tools)
        self._open: GlmCallParser | None = None  # the call being read (the stream reads one at a time)

    def new_call(self) -> GlmCallParser:
        self._open = GlmCallParser(self._properties)
        return self._open

    def body_is_open(self, body: str) -> bool:
        # Inside a value until its `</arg_value>`: values are raw text (often code) and may mention </tool_call>.
        return self._open is not None and self._open.in_value

    def call_tag(self, name: str) -> tuple[str, str]:
        return f"{TOOL_CALL_OPEN}{name}", TOOL_CALL_CLOSE


class GlmCallParser:
    """Reads one call body as it grows, each character once: the name, then `<arg_key>`/`<arg_value>` pairs."""

    def __init__(self, properties: dict[str, dict]):
        self._all_properties = properties
        self._properties: dict[str, dict] = {}  # the called function's parameter schemas
        self._name: str | None = None
        self._phase = "pairs"  # between pairs, or inside a "key" or a "value"; "done" once the format breaks
        self._position = 0  # where the open key or value starts, or where the next pair may start
        self._searched = 0  # the open key or value has no end before this
        self._key = ""  # the key whose value is open
        self._keys: list[str] = []  # parameters already streamed

    @property
    def name(self) -> str | None:
        return self._name

    @property
    def in_value(self) -> bool:
        return self._phase == "value"

    def update(self, body: str) -> str:
        if self._name is None:
            start = body.find(ARG_KEY_OPEN)
            if start < 0 or (name := _call_name(body[:start])) is None:
                return ""
            self._name, self._position = name, start
            self._properties = self._all_properties.get(name, {})
        fragments = []
        while (fragment := self._step(body)) is not None:
            fragments.append(fragment)
        return "".join(fragments)

    def complete(self, body: str) -> bool:
        """Between pairs (or after the name): a new call or the closing tag ends this one here."""
        if self._name is None:
            return _call_name(body) is not None
        return self._phase == "done" or (self._phase == "pairs" and self._position == len(body))

    def could_be_call(self, body: str) -> bool:
        start = body.find(ARG_KEY_OPEN, 0, _MAX_NAME + len(ARG_KEY_OPEN))
        head = body[:start] if start >= 0 else body
        if len(head) > _MAX_NAME:
            return False
        if start < 0 and "<" in head:
            head, tail = head.split("<", 1)
            if not ARG_KEY_OPEN.startswith("<" + tail):
                return False
        return _call_name(head) is not None if start >= 0 else (not head.strip() or _call_name(head) is not None)

    def close(self, body: str) -> ParsedCall | None:
        if self._name is None:
            name = _call_name(body)
            return None if name is None else ParsedCall(name, "{}")
        return ParsedCall(self._name, "}" if self._keys else "{}")

    def _step(self, body: str) -> str | None:
        """Reads the next tag, key or value: the argument text it adds, or None when more text is needed."""
        if self._phase in ("key", "value"):
            close = ARG_KEY_CLOSE if self._phase == "key" else ARG_VALUE_CLOSE
            end = body.find(close, max(self._position, self._searched - len(close)))
            if end < 0:
                self._searched = len(body)
                return None
            text, self._position = body[self._position : end], end + len(close)
            if self._phase == "key":
                self._phase, self._key = "after key", text.strip()
                return ""
            self._phase = "pairs"
            return self._pair(self._key, text)
        if self._phase == "done":
            return None
        while self._position < len(body) and body[self._position] in _LAYOUT:
            self._position += 1
        expected = ARG_KEY_OPEN if self._phase == "pairs" else ARG_VALUE_OPEN
        rest = body[self._position : self._position + len(expected)]
        if rest == expected:
            self._phase = "key" if self._phase == "pairs" else "value"
            self._position = self._searched = self._position + len(expected)
            return ""
        if not expected.startswith(rest):
            self._phase = "done"  # text that breaks the format: the arguments end here
        return None

    def _pair(self, key: str, raw: str) -> str:
        """One `"key": value` member of the arguments, or '' for a repeated key."""
        if key in self._keys:
            return ""
        value = coerce_parameter(raw, self._properties.get(key))
        self._keys.append(key)
        lead = "{" if len(self._keys) == 1 else ", "
        return f"{lead}{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"


def _call_name(head: str) -> str | None:
    """The function name a call body starts with (everything before its first pair), or None if it is not one."""
    if len(head) > _MAX_NAME:
        return None
    match = _NAME.fullmatch(head)
    return match.group(1) if match else None
