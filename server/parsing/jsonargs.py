"""JSON helpers for tool-call arguments: keep the model's own bytes where they are valid."""
from __future__ import annotations

import json
import re

from server import json_text

_WS = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()


def is_json_object(text: str) -> bool:
    try:
        return isinstance(json_text.loads(text), dict)
    except ValueError:
        return False


def object_members(text: str) -> dict[str, tuple[object, str]] | None:
    """The top-level members of the JSON object `text` as {key: (value, raw value text)}, or None when `text` is
    not exactly one JSON object. The raw text lets a parser pass arguments through byte for byte."""
    skip = lambda i: _WS.match(text, i).end()  # noqa: E731
    try:
        i = skip(0)
        if not text.startswith("{", i):
            return None
        i = skip(i + 1)
        members: dict[str, tuple[object, str]] = {}
        if text.startswith("}", i):
            return members if skip(i + 1) == len(text) else None
        while True:
            key, i = _DECODER.raw_decode(text, i)
            if not isinstance(key, str):
                return None
            i = skip(i)
            if not text.startswith(":", i):
                return None
            start = skip(i + 1)
            value, end = _DECODER.raw_decode(text, start)
            members[key] = (value, text[start:end])
            i = skip(end)
            if text.startswith(",", i):
                i = skip(i + 1)
            elif text.startswith("}", i):
                return members if skip(i + 1) == len(text) else None
            else:
                return None
    except ValueError:
        return None


def ends_inside_string(text: str) -> bool:
    """True when `text` (the start of some JSON) ends inside a string value or key."""
    inside = escaped = False
    for char in text:
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = inside
        elif char == '"':
            inside = not inside
    return inside
