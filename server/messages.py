"""`POST /v1/messages` (Anthropic Messages, for Claude Code) and `POST /v1/messages/count_tokens`: a thin adapter over
the chat pipeline. The request becomes a chat request (server/messages_input.py); the parsed deltas become content
blocks (`text`, `thinking`, `tool_use`), one JSON message or Anthropic's SSE events:

`message_start`, `ping`, then per block `content_block_start` / `content_block_delta` (`text_delta`,
`thinking_delta`, `input_json_delta` as the arguments are generated) / `content_block_stop`, then `message_delta`
(stop reason, usage) and `message_stop`.
"""
from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

from server.anthropic_protocol import CountTokensRequest, MessagesRequest, anthropic_sse
from server.async_engine import RequestStream
from server.chat import ChatPlan, plan_chat, record_plan, render_chat, with_cached_content
from server.pipeline import ChoiceState, Delta, choice_states, parsed_updates
from server.context import ServingContext
from server.generation import Usage
from server.messages_input import FORMAT_PARAMS, breakpoints, to_chat_request
from server.protocol import APIError
from server.session import claude_code_session

Event = tuple[str, dict[str, Any]]  # (event name, payload)

_BLOCK_TYPES = {"text": "text", "reasoning": "thinking", "call": "tool_use", "arguments": "tool_use"}


def plan_messages(
    ctx: ServingContext, req: MessagesRequest, body: dict[str, Any], cache_salt: str | None,
    headers: Mapping[str, str],
) -> ChatPlan:
    chat = to_chat_request(req, ctx.family)
    try:
        return plan_chat(ctx, chat, body, cache_salt, int(time.time()),
                         session=claude_code_session(headers, req.metadata), endpoint="messages", id_prefix="msg",
                         breakpoints=breakpoints(req))
    except APIError as exc:
        raise exc.renamed(FORMAT_PARAMS) from None


def count_tokens(ctx: ServingContext, req: CountTokensRequest, cache_salt: str | None) -> dict[str, int]:
    """The prompt's length in tokens, rendered exactly as `/v1/messages` renders it."""
    ctx.check_model(req.model)
    chat, _ = with_cached_content(ctx, to_chat_request(req, ctx.family), cache_salt)
    return {"input_tokens": len(ctx.encode(render_chat(ctx, chat)))}


class ContentBlocks:
    """The message's content blocks, built from parsed deltas; `add` returns the stream events for each delta."""

    def __init__(self) -> None:
        self.blocks: list[dict[str, Any]] = []
        self._arguments: list[str] = []  # per block: the tool_use input JSON as generated
        self._open = False

    def add(self, delta: Delta) -> list[Event]:
        kind = _BLOCK_TYPES[delta.kind]
        events = []
        if delta.kind == "call" or not self._open or self.blocks[-1]["type"] != kind:
            events += self.close()
            events.append(self._start(delta, kind))
        if delta.kind != "call":
            events.append(("content_block_delta", {"index": len(self.blocks) - 1, "delta": self._grow(delta)}))
        return events

    def close(self) -> list[Event]:
        if not self._open:
            return []
        self._open = False
        block = self.blocks[-1]
        if block["type"] == "tool_use":
            block["input"] = _json_object(self._arguments[-1])
        return [("content_block_stop", {"index": len(self.blocks) - 1})]

    def _start(self, delta: Delta, kind: str) -> Event:
        if kind == "tool_use":
            block: dict[str, Any] = {"type": "tool_use", "id": delta.call_id, "name": delta.text, "input": {}}
        elif kind == "thinking":
            block = {"type": "thinking", "thinking": "", "signature": ""}
        else:
            block = {"type": "text", "text": ""}
        self.blocks.append(block)
        self._arguments.append("")
        self._open = True
        return "content_block_start", {"index": len(self.blocks) - 1, "content_block": dict(block)}

    def _grow(self, delta: Delta) -> dict[str, Any]:
        block = self.blocks[-1]
        if delta.kind == "arguments":
            self._arguments[-1] += delta.text
            return {"type": "input_json_delta", "partial_json": delta.text}
        field = "thinking" if delta.kind == "reasoning" else "text"
        block[field] += delta.text
        return {"type": f"{field}_delta", field: delta.text}


def _json_object(text: str) -> dict[str, Any]:
    """A tool call's input; arguments that are not a JSON object (output cut off mid-call) give {}."""
    try:
        value = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _message(ctx: ServingContext, plan: ChatPlan, content: list[dict], state: ChoiceState | None) -> dict[str, Any]:
    reason, sequence = state.finish(plan.req.max_tokens).anthropic() if state else (None, None)
    return {
        "id": plan.request_id, "type": "message", "role": "assistant", "model": ctx.model_name, "content": content,
        "stop_reason": reason, "stop_sequence": sequence, "usage": _usage(ctx, plan, state),
    }


def _usage(ctx: ServingContext, plan: ChatPlan, state: ChoiceState | None) -> dict[str, int]:
    usage = Usage.of([plan.prompt], len(state.choice.token_ids) if state else 0)
    return usage.anthropic(plan.pinned_tokens, ctx.engine.engine.cfg.block_size)


async def complete_messages(ctx: ServingContext, plan: ChatPlan, stream: RequestStream) -> dict[str, Any]:
    [state] = states = choice_states(ctx, plan, streaming=False)
    blocks = ContentBlocks()
    try:
        async for update in parsed_updates(ctx, plan, stream, states):
            for delta in update.deltas:
                blocks.add(Delta.of(delta))
    finally:
        record_plan(ctx, plan)
    blocks.close()
    return _message(ctx, plan, blocks.blocks, state)


async def stream_messages(ctx: ServingContext, plan: ChatPlan, stream: RequestStream) -> AsyncIterator[str]:
    """`message_start` waits for the first output, which says how much of the prompt came from the cache."""
    [state] = states = choice_states(ctx, plan, streaming=True)
    blocks = ContentBlocks()
    started = False
    try:
        async for update in parsed_updates(ctx, plan, stream, states):
            if not started:
                started = True
                yield anthropic_sse("message_start", {"message": _message(ctx, plan, [], None)})
                yield anthropic_sse("ping", {})
            for delta in update.deltas:
                for event, payload in blocks.add(Delta.of(delta)):
                    yield anthropic_sse(event, payload)
    finally:
        record_plan(ctx, plan)
    for event, payload in blocks.close():
        yield anthropic_sse(event, payload)
    reason, sequence = state.finish(plan.req.max_tokens).anthropic()
    yield anthropic_sse("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                          "usage": _usage(ctx, plan, state)})
    yield anthropic_sse("message_stop", {})
