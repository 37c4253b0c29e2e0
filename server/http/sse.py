"""Server-sent events, the framing every streaming API shares: one event is an optional `event:` line (Anthropic and
Responses name their events), a `data:` line of compact JSON, and a blank line. JSON is written by orjson: the
per-token chunks of hundreds of concurrent streams are a large part of the event loop's work, and orjson writes them
about ten times faster than `json.dumps` (non-finite floats become null, as JSON has no other way to say them)."""
from __future__ import annotations

import json
from typing import Any

import orjson

SSE_DONE = "data: [DONE]\n\n"  # OpenAI's end of a chat or text completion stream


def json_text(payload: Any) -> str:
    """Compact JSON, non-ASCII characters as they are. orjson refuses integers beyond 64 bits, which a request may
    carry and a stream echo (Responses' `response.created` repeats the request's fields): those go through `json`."""
    try:
        return orjson.dumps(payload).decode()
    except orjson.JSONEncodeError:
        return json.dumps(payload, ensure_ascii=False, separators=(",", ":"), allow_nan=True)


def sse(payload: dict[str, Any], event: str | None = None) -> str:
    data = f"data: {json_text(payload)}\n\n"
    return data if event is None else f"event: {event}\n{data}"
