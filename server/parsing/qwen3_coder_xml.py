"""Qwen3-Coder XML tool calls:
`<tool_call>⏎<function=NAME>⏎<parameter=P>⏎VALUE⏎</parameter>⏎</function>⏎</tool_call>`, values typed by schema."""
from __future__ import annotations

import json
import re

from server.parsing.deltas import ParsedCall
from server.parsing.param_types import coerce_parameter
from server.parsing.qwen_json import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*)</function>\s*", re.DOTALL)
# A parameter ends at its closing tag; a missing `</parameter>` is tolerated before the next parameter or the end.
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.DOTALL)


class Qwen3CoderFormat:
    call_open = TOOL_CALL_OPEN
    call_close = TOOL_CALL_CLOSE
    block_open = None
    block_close = None
    trims_around_calls = True

    def __init__(self, tools: list[dict] | None):
        self._properties: dict[str, dict] = {}
        for tool in tools or []:
            function = tool.get("function") or {}
            properties = (function.get("parameters") or {}).get("properties")
            if isinstance(function.get("name"), str) and isinstance(properties, dict):
                self._properties[function["name"]] = properties

    def parse_call(self, body: str) -> ParsedCall | None:
        match = _FUNCTION.fullmatch(body)
        if match is None:
            return None
        name, inner = match.group(1).strip(), match.group(2)
        if not name:
            return None
        properties = self._properties.get(name, {})
        arguments: dict[str, object] = {}
        position = 0
        while inner[position:].strip():
            parameter = _PARAMETER.match(inner, position)
            if parameter is None or parameter.end() == position:
                return None
            key = parameter.group(1).strip()
            arguments[key] = coerce_parameter(_strip_one_newline(parameter.group(2)), properties.get(key))
            position = parameter.end()
        return ParsedCall(name, json.dumps(arguments, ensure_ascii=False))

    def body_is_open(self, body: str) -> bool:
        # Inside <function=…> until </function>: values are raw text (often code) and may mention </tool_call>.
        return body.lstrip().startswith("<function=") and "</function>" not in body

    def call_prefix(self, name: str | None) -> str:
        if name is None:
            return f"{TOOL_CALL_OPEN}\n<function="
        return f"{TOOL_CALL_OPEN}\n<function={name}>\n"


def _strip_one_newline(value: str) -> str:
    """The template writes `>⏎{value}⏎</parameter>`: exactly one newline on each side is markup."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value
