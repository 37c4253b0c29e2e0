"""Gemma 3's tool calls, as Google's function-calling guide prompts them (server/rendering/native/gemma3.py):
`{"name": NAME, "parameters": {…}}`, one object per call, calls a line apart, nothing else in the reply. No token
marks a call: one starts where the model writes `{"name"` outside a code fence, and ends where its object does (the
next call, the end of the turn or of the output); an object that turns out not to be a call is content again.
"""
from __future__ import annotations

import json
import re

from server.parsing.deltas import ParsedCall
from server.parsing.json_call import JsonCallParser
from server.parsing.jsonargs import ends_inside_string, object_members

CALL_OPEN = '{"name"'
# Never written: a call ends with its object (the parser reads where), not with a tag
_NO_CLOSE = "<|gemma-call-end|>"

# After `{"name"`: the name, then the parameters object's opening brace ("arguments" read too, as fine-tunes write it)
_HEADER = re.compile(r'\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:parameters|arguments)"\s*:\s*(?=\{)', re.DOTALL)


def _header(body: str) -> tuple[str, int] | None:
    match = _HEADER.match(body)
    if match is None:
        return None
    try:
        name = json.loads(match.group(1))
    except ValueError:
        return None
    return (name, match.end()) if name else None


def _parse_whole(body: str) -> ParsedCall | None:
    """A call whose header did not stream (a name with escapes, members in another order): the whole object."""
    members = object_members(CALL_OPEN + body.rstrip())
    if members is None:
        return None
    name = members["name"][0]
    value, raw = members.get("parameters") or members.get("arguments") or ({}, "{}")
    if not isinstance(name, str) or not name or not isinstance(value, dict):
        return None
    return ParsedCall(name, raw)


class _CallParser(JsonCallParser):
    def could_be_call(self, body: str) -> bool:
        """Until its header: `{"name"` in prose (`{"name": "Ada"}`) is not a call once an object closes first."""
        return "}" not in body or _header(body) is not None


class GemmaJsonFormat:
    call_open = CALL_OPEN
    call_close = _NO_CLOSE
    block_open = None
    block_close = None
    trims_around_calls = True  # the template trims the turn and puts calls a line after the text
    call_separator = "\n"
    argument_style = "json"
    calls_prefix = ""

    def __init__(self, tools: list[dict] | None = None):
        del tools  # arguments are JSON: nothing to type

    def new_call(self) -> JsonCallParser:
        return _CallParser(_header, _parse_whole)

    def body_is_open(self, body: str) -> bool:
        return ends_inside_string(body)

    def call_tag(self, name: str) -> tuple[str, str]:
        # As the renderer writes a call: the name first, then the parameters, the object closed after them
        return f'{CALL_OPEN}: {json.dumps(name, ensure_ascii=False)}, "parameters": ', "}"

