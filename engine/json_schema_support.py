"""Which JSON schemas constrained decoding can guarantee: the output of a schema that passes `check_json_schema`
always validates against it (with the schema compiled as `enforceable_schema` rewrites it).

xgrammar compiles most of JSON Schema, but silently ignores a few assertion keywords (measured with xgrammar 0.2.8:
an output that violates them is accepted). A schema using one of them is refused with the keyword and where it is,
rather than served with a guarantee that does not hold. Annotations (`title`, `description`, unknown `format`s...)
are not assertions and pass. `oneOf` is enforced as `anyOf` (its alternatives are expected to be disjoint).
"""
from __future__ import annotations

import json
import re
from typing import Any

_XGRAMMAR_LOCATION = re.compile(r"^\[[\d:]+\] [^:]+:\d+: ")  # "[16:25:11] /project/cpp/x.cc:4950: " in C++ errors

# Keyword -> why it cannot be enforced (xgrammar accepts output that violates it).
_IGNORED = {
    "not": "'not' is not supported",
    "if": "'if'/'then'/'else' are not supported",
    "then": "'if'/'then'/'else' are not supported",
    "else": "'if'/'then'/'else' are not supported",
    "contains": "'contains' is not supported",
    "minContains": "'minContains' is not supported",
    "maxContains": "'maxContains' is not supported",
    "dependentRequired": "'dependentRequired' is not supported",
    "dependentSchemas": "'dependentSchemas' is not supported",
    "dependencies": "'dependencies' is not supported",
}
# Keywords whose value is a schema, a list of schemas, or a map of name -> schema: where the walk descends.
_SCHEMA = ("items", "additionalProperties", "unevaluatedProperties", "unevaluatedItems", "propertyNames",
           "additionalItems")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")


def check_json_schema(schema: Any) -> None:
    """ValueError naming the first part of `schema` that constrained decoding cannot enforce."""
    if not isinstance(schema, (dict, bool)):
        raise ValueError("a JSON schema must be an object")
    _walk(schema, "")
    import xgrammar as xgr

    try:
        xgr.Grammar.from_json_schema(json.dumps(enforceable_schema(schema)), any_whitespace=False)
    except RuntimeError as exc:  # xgrammar reports schema errors as RuntimeError
        raise ValueError(f"the schema cannot be enforced: {clean_error(exc)}") from None


def _walk(schema: Any, path: str) -> None:
    if not isinstance(schema, dict):
        return
    where = path or "the schema's root"
    for keyword, reason in _IGNORED.items():
        if keyword in schema:
            raise ValueError(f"{where}: {reason} by constrained decoding")
    if "format" in schema and ("minLength" in schema or "maxLength" in schema):
        raise ValueError(f"{where}: 'format' combined with 'minLength'/'maxLength' is not supported by constrained "
                         "decoding; drop the bounds or the format, or write a 'pattern'")
    if schema.get("uniqueItems") is True:
        raise ValueError(f"{where}: 'uniqueItems' is not supported by constrained decoding")
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        raise ValueError(f"{where}: 'allOf' with more than one schema is not supported by constrained decoding")
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        raise ValueError(f"{where}: '$ref' to another document ({ref}) is not supported; inline it or use $defs")
    for keyword in _SCHEMA:
        _walk(schema.get(keyword), _join(path, keyword))
    for keyword in _SCHEMA_LISTS:
        subs = schema.get(keyword)
        for i, sub in enumerate(subs if isinstance(subs, list) else []):
            _walk(sub, f"{_join(path, keyword)}[{i}]")
    for keyword in _SCHEMA_MAPS:
        members = schema.get(keyword)
        for name, sub in (members.items() if isinstance(members, dict) else []):
            _walk(sub, _join(_join(path, keyword), name))


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


# Literal values, not schemas: the rewrite below must not touch them.
_LITERALS = ("const", "enum", "default", "examples")
# The characters a JSON string holds unescaped, as code points: U+0020-U+10FFFF but `"`, `\` and the UTF-16
# surrogates (U+D800-U+DFFF, which have no UTF-8 encoding).
_JSON_STRING_CHAR = " !#-\\[\\]-\ud7ff\ue000-\U0010ffff"


def enforceable_schema(schema: Any) -> Any:
    """`schema` rewritten around xgrammar's flaws in strings (0.2.8, 0.2.9): one with minLength/maxLength is compiled
    to a run of any characters but `"`, `\\`, CR and LF, so a raw tab (invalid inside a JSON string) can be
    generated; every string accepts the UTF-8-style bytes of surrogate code points (ED A0..BF ..), so the text is not
    valid UTF-8; and a `pattern` loses its string's minLength/maxLength. A pattern over the code points JSON allows
    unescaped, with the same bounds, gives valid JSON whose value meets the lengths; a `pattern` with bounds gets
    them composed into its regex (`bounded_pattern`). The bounds then leave the schema: the pattern holds them."""
    if isinstance(schema, list):
        return [enforceable_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in _LITERALS else enforceable_schema(v) for k, v in schema.items()}
    bounded = "minLength" in out or "maxLength" in out
    if isinstance(out.get("pattern"), str) and bounded:
        out["pattern"] = bounded_pattern(out["pattern"], out.pop("minLength", 0), out.pop("maxLength", None))
    elif out.get("type") == "string" and not any(key in out for key in ("pattern", "format", "enum", "const")):
        low, high = out.pop("minLength", 0), out.pop("maxLength", "")
        out["pattern"] = f"^[{_JSON_STRING_CHAR}]{{{low},{high}}}$"
    return out


# One regex atom that matches exactly one character: an escape (\d, \., \u00e9, \x41), a class, `.`, a literal.
_ATOM = re.compile(r"\\u[0-9a-fA-F]{4}|\\x[0-9a-fA-F]{2}|\\.|\[(?:\\.|[^\]\\])(?:\\.|[^\]\\])*\]|\.|[^\\()|*+?{}\[\]^$]")
_QUANTIFIER = re.compile(r"\*|\+|\?|\{(\d+)\}|\{(\d+),(\d*)\}")


def bounded_pattern(pattern: str, min_length: int, max_length: int | None) -> str:
    """`pattern` with the string length held to [min_length, max_length] inside the regex itself. Composable when
    the pattern is a sequence of one-character atoms, each with an optional quantifier, at most one of them of
    variable count (`^[a-z]+$`, `[A-Z][a-z0-9_]*`, `\\d{3}-\\d{2,4}`): that atom's count takes the bounds' slack.
    Anything else (groups, alternation, two variable runs) raises ValueError: the length cannot be enforced."""
    body = pattern[1:] if pattern.startswith("^") else pattern
    body = body[:-1] if body.endswith("$") and not body.endswith("\\$") else body
    atoms: list[tuple[str, int, int | None]] = []  # (atom, min count, max count)
    at = 0
    while at < len(body):
        atom = _ATOM.match(body, at)
        if atom is None:
            raise ValueError(f"'pattern' {pattern!r} combined with 'minLength'/'maxLength' can be enforced only when "
                             "it is a sequence of single characters or classes, each with an optional quantifier")
        at = atom.end()
        count = _QUANTIFIER.match(body, at)
        low, high = _counts(count)
        at = count.end() if count else at
        atoms.append((atom.group(), low, high))
    variable = [i for i, (_, low, high) in enumerate(atoms) if low != high]
    if len(variable) > 1:
        raise ValueError(f"'pattern' {pattern!r} has more than one run of variable length: combined with "
                         "'minLength'/'maxLength' it cannot be enforced")
    fixed = sum(low for i, (_, low, _) in enumerate(atoms) if i not in variable)
    if variable:
        [i] = variable
        atom, low, high = atoms[i]
        new_low = max(low, min_length - fixed)
        caps = [c for c in (high, None if max_length is None else max_length - fixed) if c is not None]
        new_high = min(caps) if caps else None
        if new_high is not None and new_high < new_low:
            raise ValueError(f"'pattern' {pattern!r} cannot match a string of length {min_length} to {max_length}")
        atoms[i] = (atom, new_low, new_high)
    elif fixed < min_length or (max_length is not None and fixed > max_length):
        raise ValueError(f"'pattern' {pattern!r} matches only strings of length {fixed}, outside "
                         f"'minLength'/'maxLength'")
    return "^" + "".join(_quantified(*part) for part in atoms) + "$"


def _quantified(atom: str, low: int, high: int | None) -> str:
    if low == high:
        return atom if low == 1 else f"{atom}{{{low}}}"
    return f"{atom}{{{low},{'' if high is None else high}}}"


def _counts(quantifier: re.Match | None) -> tuple[int, int | None]:
    if quantifier is None:
        return 1, 1
    text = quantifier.group()
    if text in ("*", "+", "?"):
        return {"*": (0, None), "+": (1, None), "?": (0, 1)}[text]
    if quantifier.group(1) is not None:
        return int(quantifier.group(1)), int(quantifier.group(1))
    return int(quantifier.group(2)), int(quantifier.group(3)) if quantifier.group(3) else None


def clean_error(exc: Exception) -> str:
    """xgrammar's message without the C++ source location."""
    lines = str(exc).strip().splitlines()
    return _XGRAMMAR_LOCATION.sub("", lines[0]) if lines else repr(exc)
