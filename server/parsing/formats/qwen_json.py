"""Qwen / Hermes JSON tool calls: `<tool_call>⏎{"name": …, "arguments": {…}}⏎</tool_call>`, one block per call."""
from __future__ import annotations

import json
import re

from server.parsing.deltas import ParsedCall
from server.parsing.json_call import JsonCallParser
from server.parsing.jsonargs import ends_inside_string, is_json_object, object_members

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

# The streamable start of a call: the name first, then the arguments (or "parameters") object's opening brace.
_HEADER = re.compile(
    r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)', re.DOTALL
)


class QwenJsonFormat:
    call_open = TOOL_CALL_OPEN
    call_close = TOOL_CALL_CLOSE
    block_open = None
    block_close = None
    calls_prefix = ""
    trims_around_calls = True
    call_separator = "\n"
    argument_style = "json"

    def new_call(self) -> JsonCallParser:
        return JsonCallParser(_header, self.parse_call, opening="{")

    def parse_call(self, body: str) -> ParsedCall | None:
        members = object_members(body)
        if members is None or "name" not in members:
            return None
        name = members["name"][0]
        if not isinstance(name, str) or not name:
            return None
        # "parameters" is what some fine-tunes write instead of "arguments".
        value, raw = members.get("arguments") or members.get("parameters") or ({}, "{}")
        if isinstance(value, dict):
            return ParsedCall(name, raw)
        if isinstance(value, str) and is_json_object(value):  # arguments double-encoded as a JSON string
            return ParsedCall(name, value)
        return None

    def body_is_open(self, body: str) -> bool:
        return ends_inside_string(body)

    def call_tag(self, name: str) -> tuple[str, str]:
        # As the template renders a call: `tojson` spacing, the name first.
        begin = f'{TOOL_CALL_OPEN}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '
        return begin, f"}}\n{TOOL_CALL_CLOSE}"


def _header(body: str) -> tuple[str, int] | None:
    match = _HEADER.match(body)
    if match is None:
        return None
    try:
        name = json.loads(match.group(1))
    except ValueError:
        return None
    return (name, match.end()) if name else None
