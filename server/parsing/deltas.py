"""What the parsers produce: parsed calls, the final assistant message, and OpenAI chat-completion delta dicts."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class ParsedCall:
    """One tool call recognised in the model output; `arguments` is the text of a JSON object."""

    name: str
    arguments: str


@dataclass
class ParsedMessage:
    """The assistant message as the non-streaming API returns it."""

    content: str | None
    reasoning_content: str | None
    tool_calls: list[dict] = field(default_factory=list)
    finish_reason_override: Literal["tool_calls"] | None = None

    def to_message(self) -> dict:
        return {
            "role": "assistant",
            "content": self.content,
            "reasoning_content": self.reasoning_content,
            "tool_calls": self.tool_calls,
        }


def tool_call_id(id_prefix: str, index: int) -> str:
    """Ids are `call_<prefix><index as hex>`: unique within a request, reproducible given the prefix."""
    return f"call_{id_prefix}{index:04x}"


def tool_call_dict(call_id: str, name: str) -> dict:
    """A call as the final message holds it; its arguments are appended as they stream."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}


def content_delta(text: str) -> dict:
    return {"content": text}


def reasoning_delta(text: str) -> dict:
    return {"reasoning_content": text}


def tool_call_start_delta(index: int, call_id: str, name: str) -> dict:
    return {
        "tool_calls": [
            {"index": index, "id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}
        ]
    }


def tool_call_arguments_delta(index: int, fragment: str) -> dict:
    return {"tool_calls": [{"index": index, "function": {"arguments": fragment}}]}
