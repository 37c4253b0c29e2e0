"""Gemma 4's call arguments as an xgrammar EBNF grammar: `{key:value,...}` in Gemma's notation (not JSON, so
xgrammar's JSON-schema styles cannot write it), built from the tool's JSON schema.

Keys are written bare and in the order the template writes them (sorted case-insensitively), required ones always,
declared ones only; strings are `<|"|>`-quoted raw text that never holds the quote itself (a five-state automaton);
integers, numbers, `true`/`false` and `None` bare; `enum` / `const` as the listed values; arrays item by item; a
value without a type (or an object without properties) any value of the notation.
"""
from __future__ import annotations

import json
from typing import Any

from server.parsing.param_types import schema_types
from server.rendering.native.gemma4 import format_argument  # the notation's writer: constants as the template writes

# The string body: no `<|"|>` inside. State i = how much of the quote the text ends with.
_STRING_RULES = r'''
g_str ::= "<|\"|>" g_q0 "<|\"|>"
g_q0 ::= "" | [^<] g_q0 | "<" g_q1
g_q1 ::= "" | [^<|] g_q0 | "<" g_q1 | "|" g_q2
g_q2 ::= "" | [^<"] g_q0 | "<" g_q1 | "\"" g_q3
g_q3 ::= "" | [^<|] g_q0 | "<" g_q1 | "|" g_q4
g_q4 ::= "" | [^<>] g_q0 | "<" g_q1
g_int ::= "-"? [0-9]+
g_num ::= "-"? [0-9]+ ("." [0-9]+)? ([eE] [+\-]? [0-9]+)?
g_key ::= [A-Za-z0-9_.\-]+
g_any ::= g_str | g_num | "true" | "false" | "None" | g_obj | g_arr
g_obj ::= "{" (g_key ":" g_any ("," g_key ":" g_any)*)? "}"
g_arr ::= "[" (g_any ("," g_any)*)? "]"
'''
_SCALARS = {"string": "g_str", "integer": "g_int", "number": "g_num", "boolean": '("true" | "false")',
            "null": '"None"'}


def _literal(text: str) -> str:
    """An EBNF string literal of `text` (JSON escapes are EBNF's)."""
    return json.dumps(text, ensure_ascii=False)


def _notation(value: Any) -> str:
    """A constant as the template writes call arguments (bare keys)."""
    return format_argument(value, escape_keys=False)


class _Builder:
    def __init__(self) -> None:
        self.rules: list[str] = []

    def rule(self, body: str) -> str:
        name = f"g_r{len(self.rules)}"
        self.rules.append(f"{name} ::= {body}")
        return name

    def value(self, schema: Any) -> str:
        if not isinstance(schema, dict):
            return "g_any"
        for key in ("enum", "const"):
            if key in schema:
                listed = schema[key] if key == "enum" else [schema[key]]
                return "(" + " | ".join(_literal(_notation(v)) for v in listed) + ")"
        alternatives = [a for k in ("anyOf", "oneOf") for a in schema.get(k) or []]
        if alternatives:
            return "(" + " | ".join(self.value(a) for a in alternatives) + ")"
        kinds = schema_types(schema)
        if not kinds:
            return "g_any"
        return "(" + " | ".join(self._typed(kind, schema) for kind in kinds) + ")"

    def _typed(self, kind: str, schema: dict) -> str:
        if kind == "object":
            return self.object(schema)
        if kind == "array":
            item = self.value(schema.get("items"))
            return self.rule(f'"[" ({item} ("," {item})*)? "]"')
        return _SCALARS.get(kind, "g_any")

    def object(self, schema: dict) -> str:
        properties = schema.get("properties")
        if not isinstance(properties, dict) or not properties:
            return "g_obj"
        required = set(schema.get("required") or [])
        keys = sorted(properties, key=str.lower)  # the template's dictsort
        # first_i: members from key i on, none written yet; rest_i: the same after one was (a comma first)
        first, rest = ['""'], ['""']
        for key in reversed(keys):
            member = f"{_literal(key + ':')} {self.value(properties[key])}"
            after = rest[-1]
            first_alternatives = [f"{member} {after}"] + ([] if key in required else [first[-1]])
            rest_alternatives = [f'"," {member} {after}'] + ([] if key in required else [after])
            first.append(self.rule(" | ".join(first_alternatives)))
            rest.append(self.rule(" | ".join(rest_alternatives)))
        return self.rule(f'"{{" {first[-1]} "}}"')


def arguments_format(schema: dict) -> dict:
    """The arguments of a call (the text between `call:NAME` and `<tool_call|>`) as an xgrammar grammar format."""
    builder = _Builder()
    root = builder.object(schema) if isinstance(schema, dict) else "g_obj"
    grammar = "\n".join([f"root ::= {root}", *builder.rules]) + _STRING_RULES
    return {"type": "grammar", "grammar": grammar}
