"""Mistral's tool calls (Devstral Small 2 / Devstral 2, tokenizer v11+): `[TOOL_CALLS]NAME[ARGS]{…}` per call,
calls written back to back with no closing marker (the turn ends with `</s>`); v11's `NAME[CALL_ID]ID[ARGS]{…}` reads
the same (the id is not kept). The older form, `[TOOL_CALLS][{"name": …, "arguments": {…}}, …]`, holds a turn's
calls in one JSON list (read once the list is whole: all of its calls, or none when one is not a call). `[TOOL_CALLS]`
and `[ARGS]` are control tokens, so constrained decoding writes them as tokens, and several calls back to back.
"""
from __future__ import annotations

import json
import re

from server.parsing.deltas import ParsedCall
from server.parsing.json_call import JsonCallParser
from server.parsing.jsonargs import ends_inside_string, is_json_object, object_members

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
EOS = "</s>"
# Their ids in every tekken tokenizer of v11 and later (mistral-common's layout; devstral-small-tiny's tokenizer)
TOKEN_IDS = {TOOL_CALLS: 9, ARGS: 32}
# Never written: the calls end at the next call, the end of the turn or of the output
_NO_CLOSE = "[/TOOL_CALLS]"


_NAME = re.compile(r"[\w.\-]*")


class _CallParser(JsonCallParser):
    def more_calls(self, body: str) -> list[ParsedCall]:
        """The older form's calls after the first (tool_stream.CallParser)."""
        return [] if _head(body) is not None else (_listed_calls(body) or [])[1:]

    def could_be_call(self, body: str) -> bool:
        """A name (letters, digits, `_.-`) up to `[ARGS]` or `[CALL_ID]`, or the older form's list."""
        text = body.lstrip()
        if not text or text.startswith("["):
            return True
        name = _NAME.match(text).group()
        rest = text[len(name):]
        return not rest or any(m.startswith(rest[:len(m)]) for m in (ARGS, CALL_ID))


def _head(body: str) -> tuple[str, int] | None:
    """The name and where the arguments begin, once the body has reached `[ARGS]`."""
    head, sep, _ = body.partition(ARGS)
    if not sep:
        return None
    name = head.partition(CALL_ID)[0].strip()
    if not name or any(c in name for c in '{}[]"'):
        return None
    return name, len(head) + len(sep)


def _header(body: str) -> tuple[str, int] | None:
    head = _head(body)
    if head is None:
        return None
    at = len(body) - len(body[head[1]:].lstrip())
    return (head[0], at) if body.startswith("{", at) else None


def _parse_whole(body: str) -> ParsedCall | None:
    head = _head(body)
    if head is not None:
        arguments = body[head[1]:].strip()
        return ParsedCall(head[0], arguments) if is_json_object(arguments) else None
    calls = _listed_calls(body)
    return calls[0] if calls else None


def _listed_calls(body: str) -> list[ParsedCall] | None:
    """The older form: a JSON list of {"name", "arguments"} objects, or None when it is not (wholly) calls."""
    try:
        listed = json.loads(body)
    except ValueError:
        return None
    if not isinstance(listed, list) or not listed:
        return None
    calls = [_listed_call(item) for item in listed]
    return None if None in calls else calls


def _listed_call(item: object) -> ParsedCall | None:
    if not isinstance(item, dict):
        return None
    members = object_members(json.dumps(item, ensure_ascii=False))
    name = item.get("name")
    if not isinstance(name, str) or not name or members is None:
        return None
    arguments = item.get("arguments", {})
    if isinstance(arguments, str) and is_json_object(arguments):
        return ParsedCall(name, arguments)
    return ParsedCall(name, members["arguments"][1]) if isinstance(arguments, dict) and "arguments" in members \
        else (ParsedCall(name, "{}") if "arguments" not in item else None)


class MistralFormat:
    call_open = TOOL_CALLS
    call_close = _NO_CLOSE
    block_open = None
    block_close = None
    trims_around_calls = False
    call_separator = ""
    argument_style = "json"
    calls_prefix = ""

    def __init__(self, tools: list[dict] | None = None):
        del tools  # arguments are JSON: nothing to type

    def new_call(self) -> JsonCallParser:
        return _CallParser(_header, _parse_whole)

    def body_is_open(self, body: str) -> bool:
        return ends_inside_string(body)

    def call_tag(self, name: str) -> tuple[str, str]:
        return f"{TOOL_CALLS}{name}{ARGS}", ""

    def call_format(self, name: str, arguments: dict) -> dict:
        """The call as an xgrammar structural-tag format: the control tokens as tokens, the arguments ``arguments``."""
        return {"type": "sequence", "elements": [
            {"type": "token", "token": TOKEN_IDS[TOOL_CALLS]}, {"type": "const_string", "value": name},
            {"type": "token", "token": TOKEN_IDS[ARGS]}, arguments]}
