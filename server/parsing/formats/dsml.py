"""DeepSeek DSML tool calls (V3.2: a `function_calls` block; V4: a `tool_calls` block)::

    ⏎⏎<｜DSML｜function_calls>⏎<｜DSML｜invoke name="NAME">⏎<｜DSML｜parameter name="K" string="true">V</｜DSML｜parameter>⏎
    </｜DSML｜invoke>⏎</｜DSML｜function_calls>

A value with `string="true"` is raw text; with `string="false"` it is JSON (kept as written when it parses, else typed
by the tool's schema like a Qwen3-Coder value, else kept as a string, so the arguments are always a JSON object). The
arguments stream per completed parameter (`{"a": 1`, `, "b": "x"`, `}`); a call streams from its `name="…">`.
Text that breaks the format ends the call's parameters (those complete are kept), a parameter the output cuts off is
dropped, and a repeated parameter keeps its first value.
"""
from __future__ import annotations

import json
import re

from server import json_text
from server.parsing.deltas import ParsedCall
from server.parsing.param_types import coerce_parameter, tool_properties

DSML = "｜DSML｜"
INVOKE_OPEN = f"<{DSML}invoke"
INVOKE_CLOSE = f"</{DSML}invoke>"
PARAMETER_OPEN = f"<{DSML}parameter"
PARAMETER_CLOSE = f"</{DSML}parameter>"

_HEAD = re.compile(r'\s*name="([^"\n]+)">')
_MAY_BE_HEAD = re.compile(r'\s*(?:n|na|nam|name|name=|name="[^"\n]*|name="[^"\n]+")?')
_PARAMETER = re.compile(rf'\s*{PARAMETER_OPEN} name="([^"\n]*)" string="(true|false)">')
_LAYOUT = " \t\r\n"


class DsmlFormat:
    """`block`: `function_calls` (V3.2) or `tool_calls` (V4)."""

    call_open = INVOKE_OPEN
    call_close = INVOKE_CLOSE
    trims_around_calls = True  # the template writes ⏎⏎ before the block
    call_separator = "\n"
    calls_prefix = "\n\n"
    argument_style = "deepseek_xml"

    def __init__(self, block: str, tools: list[dict] | None):
        self.block_open = f"<{DSML}{block}>"
        self.block_close = f"</{DSML}{block}>"
        self._properties = tool_properties(tools)

    def new_call(self) -> DsmlCallParser:
        return DsmlCallParser(self._properties)

    def body_is_open(self, body: str) -> bool:
        # Inside a value (raw text, often code) a closing tag is text.
        return body.count(PARAMETER_OPEN) > body.count(PARAMETER_CLOSE)

    def call_tag(self, name: str) -> tuple[str, str]:
        return f'{INVOKE_OPEN} name="{name}">\n', INVOKE_CLOSE

    def block_tag(self) -> tuple[str, str]:
        return f"{self.block_open}\n", f"\n{self.block_close}"


class DsmlCallParser:
    """Reads one `invoke` body: ` name="NAME">` then parameters; anything else is not a call. MiniMax-M2's invokes
    differ only in their parameter tags and how a value is typed (formats/minimax_xml.py overrides those)."""

    parameter_open = PARAMETER_OPEN
    parameter_close = PARAMETER_CLOSE
    parameter_tag = _PARAMETER  # group 1: the key
    head = _HEAD  # group 1: the function name; Kimi-K3's calls open with their own attributes

    def __init__(self, properties: dict[str, dict]):
        self._all_properties = properties
        self._properties: dict[str, dict] = {}
        self._name: str | None = None
        self._position = 0  # where the next parameter (or the open value) starts
        self._open: re.Match | None = None  # the tag of the parameter whose value starts at `_position`
        self._searched = 0  # the open value has no closing tag before this
        self._keys: list[str] = []
        self._done = False  # text that breaks the format: the parameters end here

    @property
    def name(self) -> str | None:
        return self._name

    def could_be_call(self, body: str) -> bool:
        return self.head.match(body) is not None or _MAY_BE_HEAD.fullmatch(body) is not None

    def update(self, body: str) -> str:
        if self._name is None:
            head = self.head.match(body)
            if head is None:
                return ""
            self._name, self._position = head.group(1), head.end()
            self._properties = self._all_properties.get(self._name, {})
        fragments = []
        while not self._done and (fragment := self._step(body)) is not None:
            fragments.append(fragment)
        return "".join(fragments)

    def complete(self, body: str) -> bool:
        return self._name is not None and self._open is None

    def close(self, body: str) -> ParsedCall | None:
        if self._name is None:
            return None
        return ParsedCall(self._name, "}" if self._keys else "{}")

    def _step(self, body: str) -> str | None:
        """Reads the next parameter tag or value: the argument text it adds, or None when more text is needed."""
        close = self.parameter_close
        if self._open is not None:
            end = body.find(close, max(self._position, self._searched - len(close)))
            if end < 0:
                self._searched = len(body)
                return None
            tag, start = self._open, self._position
            self._open, self._position = None, end + len(close)
            return self._member(self.key(tag), self.value(tag, body[start:end]))
        tag = self.parameter_tag.match(body, self._position)
        if tag:
            self._open, self._position = tag, tag.end()
            self._searched = tag.end()
            return ""
        rest = body[self._position :].lstrip(_LAYOUT)
        if self.parameter_open.startswith(rest) or self.tag_unfinished(rest):
            return None  # a tag may still be arriving
        self._done = True
        return ""

    def tag_unfinished(self, rest: str) -> bool:
        """`rest` (what follows the last parameter) is a parameter tag still arriving."""
        return rest.startswith(self.parameter_open) and not any(c in rest for c in ">\n")

    def key(self, tag: re.Match) -> str:
        return tag.group(1)

    def value(self, tag: re.Match, raw: str) -> object:
        """The value of the parameter `tag` opened: raw text with `string="true"`, else JSON."""
        return raw if tag.group(2) == "true" else _json_value(raw, self._properties.get(tag.group(1)))

    def _member(self, key: str, value: object) -> str:
        """One `"key": value` member of the arguments, or '' for a repeated key."""
        if key in self._keys:
            return ""
        self._keys.append(key)
        lead = "{" if len(self._keys) == 1 else ", "
        return f"{lead}{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"


def _json_value(raw: str, schema: dict | None) -> object:
    try:
        return json_text.loads(raw)
    except ValueError:
        return coerce_parameter(raw, schema)
