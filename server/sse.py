"""Server-sent events, the framing every streaming API shares: one event is an optional `event:` line (Anthropic and
Responses name their events), a `data:` line of compact JSON, and a blank line. JSON is written by orjson: the
per-token chunks of hundreds of concurrent streams are a large part of the event loop's work, and orjson writes them
about ten times faster than `json.dumps` (non-finite floats become null, as JSON has no other way to say them)."""
from __future__ import annotations

from typing import Any

import orjson

SSE_DONE = "data: [DONE]\n\n"  # OpenAI's end of a chat or text completion stream


def json_text(payload: Any) -> str:
    """Compact JSON, non-ASCII characters as they are."""
    return orjson.dumps(payload).decode()


def sse(payload: dict[str, Any], event: str | None = None) -> str:
    data = f"data: {orjson.dumps(payload).decode()}\n\n"
    return data if event is None else f"event: {event}\n{data}"
