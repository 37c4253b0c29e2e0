"""Qwen3-Coder XML tool calls:
`<tool_call>⏎<function=NAME>⏎<parameter=P>⏎VALUE⏎</parameter>⏎</function>⏎</tool_call>`, values typed by schema.

The arguments are re-serialised (like the template's `tojson`), so they stream per completed parameter: `{"a": 1`,
then `, "b": "x"`, then `}` when the call ends. A call streams from its `<function=NAME>`; once it has, text that
breaks the format ends its parameters (the call keeps those that were complete), a parameter still open when the
output is cut off is dropped, and a repeated parameter keeps its first value, so the arguments are always valid JSON.
"""
from __future__ import annotations

import json
import re

from server.parsing.deltas import ParsedCall
from server.parsing.param_types import coerce_parameter, tool_properties
from server.parsing.formats.qwen_json import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

FUNCTION_OPEN = "<function="
FUNCTION_CLOSE = "</function>"
PARAMETER_OPEN = "<parameter="
PARAMETER_CLOSE = "</parameter>"

# An opening tag whose `>` may not have arrived yet (group 2 is empty until it has).
_FUNCTION_TAG = re.compile(r"\s*<function=([^>\n]*)(>?)")
_PARAMETER_TAG = re.compile(r"\s*<parameter=([^>\n]*)(>?)")
# A value ends at its closing tag; a missing `</parameter>` is tolerated before the next parameter.
_VALUE_END = re.compile(f"{PARAMETER_CLOSE}|{PARAMETER_OPEN}")
_LAYOUT = ("\n", "\r", "\t", " ")
# At the end of the call a value still open runs to the last `</function>`.
_LAST_VALUE = re.compile(rf"(.*){FUNCTION_CLOSE}\s*", re.DOTALL)


class Qwen3CoderFormat:
    call_open = TOOL_CALL_OPEN
    call_close = TOOL_CALL_CLOSE
    block_open = None
    block_close = None
    calls_prefix = ""
    trims_around_calls = True
    call_separator = "\n"
    argument_style = "qwen_xml"

    def __init__(self, tools: list[dict] | None):
        self._properties = tool_properties(tools)

    def new_call(self) -> CoderCallParser:
        return CoderCallParser(self._properties)

    def body_is_open(self, body: str) -> bool:
        # Inside <function=…> until </function>: values are raw text (often code) and may mention </tool_call>.
        return body.lstrip().startswith(FUNCTION_OPEN) and FUNCTION_CLOSE not in body

    def call_tag(self, name: str) -> tuple[str, str]:
        return f"{TOOL_CALL_OPEN}\n{FUNCTION_OPEN}{name}>\n", f"{FUNCTION_CLOSE}\n{TOOL_CALL_CLOSE}"


class CoderCallParser:
    """Reads one call body; a body that does not start with a function tag is never a call."""

    def __init__(self, properties: dict[str, dict]):
        self._all_properties = properties
        self._properties: dict[str, dict] = {}  # the called function's parameter schemas
        self._name: str | None = None
        self._no_call = False  # the body cannot start with a function tag any more
        self._position = 0  # where the next tag (or the open value) starts
        self._key: str | None = None  # the parameter whose value starts at `_position`
        self._searched = 0  # the open value has no end before this
        self._keys: list[str] = []  # parameters already streamed
        self._done = False  # `</function>` seen, or text that breaks the format

    @property
    def name(self) -> str | None:
        return self._name

    def update(self, body: str) -> str:
        if self._name is None and not self._no_call:
            self._read_function_tag(body)
        fragments: list[str] = []
        while self._name is not None and not self._done and (fragment := self._step(body)) is not None:
            fragments.append(fragment)
        return "".join(fragments)

    def complete(self, body: str) -> bool:
        return self._done

    def could_be_call(self, body: str) -> bool:
        match = _FUNCTION_TAG.match(body)
        if match is None:
            return FUNCTION_OPEN.startswith(body.lstrip())
        if not match.group(2):
            return match.end() == len(body)  # the tag is still arriving (a newline inside it ends the call)
        return bool(match.group(1).strip())

    def close(self, body: str) -> ParsedCall | None:
        if self._name is None:
            return None
        last = ""
        if self._key is not None and not self._done and (match := _LAST_VALUE.fullmatch(body, self._position)):
            last = self._parameter(match.group(1))
        return ParsedCall(self._name, last + ("}" if self._keys else "{}"))

    def _read_function_tag(self, body: str) -> None:
        match = _FUNCTION_TAG.match(body)
        if not self.could_be_call(body):
            self._no_call = True
        elif match and match.group(2):
            self._name, self._position = match.group(1).strip(), match.end()
            self._properties = self._all_properties.get(self._name, {})

    def _step(self, body: str) -> str | None:
        """Reads the next parameter or tag: the argument text it adds, or None when more text is needed."""
        if self._key is not None:
            end = _VALUE_END.search(body, max(self._position, self._searched - len(PARAMETER_CLOSE)))
            if end is None:
                self._searched = len(body)
                return None
            fragment = self._parameter(body[self._position : end.start()])
            self._key = None
            self._position = end.end() if end.group() == PARAMETER_CLOSE else end.start()
            return fragment
        tag = _PARAMETER_TAG.match(body, self._position)
        if tag and tag.group(2):
            self._key, self._position, self._searched = tag.group(1).strip(), tag.end(), tag.end()
            return ""
        if tag and tag.end() == len(body):
            return None  # the parameter's name is still arriving
        rest = body[self._position :].lstrip()
        if not tag and not rest.startswith(FUNCTION_CLOSE) and (
            PARAMETER_OPEN.startswith(rest) or FUNCTION_CLOSE.startswith(rest)
        ):
            return None  # a tag is still arriving
        self._done = True  # `</function>`, or text that breaks the format: the parameters end here
        return ""

    def _parameter(self, raw: str) -> str:
        """One `"key": value` member of the arguments, or '' for a repeated key."""
        key = self._key
        if key is None or key in self._keys:
            return ""
        value = coerce_parameter(_unframe(raw), self._properties.get(key))
        self._keys.append(key)
        lead = "{" if len(self._keys) == 1 else ", "
        return f"{lead}{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"


def _unframe(value: str) -> str:
    """The template writes `>⏎{value}⏎</parameter>`: one whitespace character on each side (the newline, or what a
    constrained model wrote in its place) is layout, not value."""
    value = value[1:] if value[:1] in _LAYOUT else value
    return value[:-1] if value[-1:] in _LAYOUT else value
