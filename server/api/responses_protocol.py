"""The OpenAI Responses wire format: the request body (pydantic, for validation and the OpenAPI schema) and the SSE
event framing. Errors use the OpenAI shape, as on the other OpenAI routes.

Input items and tools stay dicts: server/api/responses_input.py validates each one, names the item that is wrong, and
accepts item and tool types it has no use for (hosted tools such as `web_search`) without failing the request.
"""
from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from server.api.protocol import APIError, RequestModel
from server.http.sse import sse


class ResponsesRequest(RequestModel):
    api: ClassVar[str] = "responses"  # its fields in server/api/request_fields.py

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    store: bool = True
    stream: bool = False
    previous_response_id: str | None = None
    prompt_cache_key: str | None = Field(None, max_length=1024)
    metadata: dict[str, Any] | None = None
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    # [{"type": "compaction", "compact_threshold": N}]: compact first past N input tokens (server/api/compaction.py)
    context_management: list[Any] | None = None


class CompactRequest(ResponsesRequest):
    """`POST /v1/responses/compact` (the SDK's `responses.compact`): a conversation (`input`, `instructions`,
    `previous_response_id`; `tools` keep the summary turn's prompt the agent's) to compact. Never streamed or stored."""

    input: str | list[dict[str, Any]] = Field(default_factory=list)
    store: bool = False
    stream: Literal[False] = False


def responses_sse(event: dict[str, Any]) -> str:
    """One SSE event; the data repeats the event name as `type`."""
    return sse(event, event["type"])


def responses_error_event(exc: APIError) -> str:
    """A stream that fails after its 200: Responses' `error` event."""
    return responses_sse({"type": "error", "code": exc.code or exc.type, "message": exc.message,
                          "param": exc.param})
