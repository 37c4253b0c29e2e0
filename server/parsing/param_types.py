"""Typing raw parameter text (Qwen3-Coder XML, DSML values that are not JSON) by the tool's JSON schema."""
from __future__ import annotations

import ast
import json
import math

from server import json_text

_ALIASES = {
    "int": "integer",
    "float": "number",
    "double": "number",
    "bool": "boolean",
    "dict": "object",
    "list": "array",
    "str": "string",
    "text": "string",
}
_FAILED = object()


def schema_types(schema: dict | None) -> list[str]:
    """The JSON types a parameter schema allows, from `type` (string or list) or `anyOf`/`oneOf` alternatives."""
    if not isinstance(schema, dict):
        return []
    declared = schema.get("type")
    if isinstance(declared, str):
        names = [declared]
    elif isinstance(declared, list):
        names = [t for t in declared if isinstance(t, str)]
    else:
        names = []
        for key in ("anyOf", "oneOf"):
            for alternative in schema.get(key) or []:
                names += schema_types(alternative)
    out: list[str] = []
    for name in names:
        name = _ALIASES.get(name.lower(), name.lower())
        if name not in out:
            out.append(name)
    return out


def tool_properties(tools: list[dict] | None) -> dict[str, dict]:
    """Function name -> its parameters' schemas (`properties`), for the formats that write values as raw text."""
    out: dict[str, dict] = {}
    for tool in tools or []:
        function = tool.get("function") or {}
        properties = (function.get("parameters") or {}).get("properties")
        if isinstance(function.get("name"), str) and isinstance(properties, dict):
            out[function["name"]] = properties
    return out


def coerce_parameter(raw: str, schema: dict | None) -> object:
    """The value of one parameter: the first allowed non-string type that the text parses as, else the text itself.

    Unknown parameters and schemas without a type stay strings, which never loses what the model wrote.
    """
    for type_name in sorted(schema_types(schema), key=lambda t: t == "string"):
        converter = _CONVERTERS.get(type_name)
        if converter is None:
            continue
        value = converter(raw)
        if value is not _FAILED:
            return value
    return raw


def _null(raw: str) -> object:
    return None if raw.strip() in ("null", "None") else _FAILED


def _boolean(raw: str) -> object:
    return {"true": True, "false": False}.get(raw.strip().lower(), _FAILED)


def _number(raw: str) -> object:
    text = raw.strip()
    try:
        value = json_text.loads(text)
    except ValueError:
        try:
            value = float(text)
        except ValueError:
            return _FAILED
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return _FAILED
    return value


def _integer(raw: str) -> object:
    value = _number(raw)
    if isinstance(value, float):
        return int(value) if value.is_integer() else _FAILED
    return value


def _structured(kind: type):
    def convert(raw: str) -> object:
        text = raw.strip()
        try:
            value = json_text.loads(text)
        except ValueError:
            try:  # the July 2025 template rendered history values with Python str(), so models echo that form
                value = ast.literal_eval(text)
                json.dumps(value)
            except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                return _FAILED
        return value if isinstance(value, kind) else _FAILED

    return convert


_CONVERTERS = {
    "null": _null,
    "boolean": _boolean,
    "integer": _integer,
    "number": _number,
    "object": _structured(dict),
    "array": _structured(list),
    "string": lambda raw: raw,
}
