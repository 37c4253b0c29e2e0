"""JSON text from a request (its body, a tool call's `arguments` string, `metadata.user_id`) or from the model's
output, parsed strictly and within bounds: `loads` is `json.loads` that refuses `NaN` / `Infinity` (not JSON; they
would fail the JSON response later, a 500), integers past Python's digit limit (4,300: `int` refuses to convert
them), and nesting past ``max_depth`` (or Python's recursion limit), each as a `json.JSONDecodeError`, so that every
caller's handling of bad JSON covers them (a 400 for a request, plain text for model output)."""
from __future__ import annotations

import json
from typing import Any

MAX_DEPTH = 128  # as the request body's default nesting limit (--max-json-depth)


class TooDeep(json.JSONDecodeError):
    """Nested deeper than allowed."""


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def loads(text: str | bytes, max_depth: int | None = MAX_DEPTH) -> Any:
    """``text`` as JSON; ``max_depth``: the deepest nesting of arrays and objects allowed (None: Python's recursion
    limit alone)."""
    from server.http.limits import depth  # server.http.limits imports server.api.protocol; this module stays import-light

    doc = text if isinstance(text, str) else text.decode("utf-8", "replace")
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise TooDeep(f"nested deeper than {max_depth or 'the parser allows'} levels", doc, 0) from None
    except json.JSONDecodeError:
        raise
    except ValueError as exc:  # NaN / Infinity, or an integer past the digit limit
        raise json.JSONDecodeError(str(exc).split(";")[0], doc, 0) from None
    if max_depth is not None and depth(value) > max_depth:
        raise TooDeep(f"nested deeper than {max_depth} levels", doc, 0)
    return value
