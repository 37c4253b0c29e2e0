"""The Anthropic Messages wire format: request bodies (pydantic, for validation and the OpenAPI schema), the error
shape, and the SSE event framing.

As for the OpenAI routes, unknown fields are accepted and ignored. Content blocks stay dicts:
`server/api/messages_input.py` validates each one and names the block
that is wrong, so a malformed block is a 400, never a 500.
"""
from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from server.api.protocol import APIError, RequestModel
from server.http.sse import sse

# The Anthropic error type of each status this server answers with.
_ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    413: "request_too_large", 429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
}


def anthropic_error_body(exc: APIError) -> dict[str, Any]:
    """`{"type": "error", "error": {"type", "message"}}`, the type picked by status as Anthropic does."""
    kind = _ERROR_TYPES.get(exc.status, "api_error" if exc.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": exc.message}}


def anthropic_sse(event: str, payload: dict[str, Any]) -> str:
    """One SSE event: Anthropic names every event (`event:` line) and repeats the name as `type` in the data."""
    return sse({"type": event, **payload}, event)


def anthropic_error_event(exc: APIError) -> str:
    body = anthropic_error_body(exc)
    return anthropic_sse("error", {"error": body["error"]})


ContentBlocks = list[dict[str, Any]]


class AnthropicMessage(RequestModel):
    # "system" is not in Anthropic's API, but Claude Code sends mid-conversation system messages.
    role: Literal["user", "assistant", "system"]
    content: str | ContentBlocks


class Conversation(RequestModel):
    """What a prompt is made of: shared by messages and count_tokens."""

    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | ContentBlocks | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    cached_content: str | None = Field(None, max_length=128)  # a named cache this request continues (/v1/caches)
    # {"format": {"type": "json_schema", "schema": ...}, "effort": ...}; the effort can change the prompt (DeepSeek-V4)
    output_config: dict[str, Any] | None = None
    # {"edits": [...]}: clear old tool results / thinking before rendering (server/api/context_edits.py)
    context_management: dict[str, Any] | None = None


class MessagesRequest(Conversation):
    api: ClassVar[str] = "messages"  # its fields in server/api/request_fields.py
    max_tokens: int | None = Field(None, ge=1)  # required by Anthropic; here it defaults to the room left
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    metadata: dict[str, Any] | None = None
    output_format: dict[str, Any] | None = None  # the structured-outputs beta's name for output_config.format


class CountTokensRequest(Conversation):
    pass
