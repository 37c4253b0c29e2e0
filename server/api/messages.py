"""`POST /v1/messages` (Anthropic Messages, for Claude Code) and `POST /v1/messages/count_tokens`: a thin adapter over
the chat pipeline. The request becomes a chat request (server/api/messages_input.py); the parsed deltas become content
blocks (`text`, `thinking`, `tool_use`), one JSON message or Anthropic's SSE events:

`message_start`, `ping`, then per block `content_block_start` / `content_block_delta` (`text_delta`,
`thinking_delta`, `input_json_delta` as the arguments are generated) / `content_block_stop`, then `message_delta`
(stop reason, usage) and `message_stop`.
"""
from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import replace
from typing import Any

from server import json_text
from server.api.anthropic_protocol import CountTokensRequest, MessagesRequest, anthropic_sse
from server.pipeline.async_engine import RequestStream
from server.pipeline.plan import Plan, plan_turn, record_plan, render_turn, with_cached_content
from server.pipeline.context import ServingContext
from server.pipeline.generation import Usage
from server.pipeline.images import expand, turn_images
from server.api.context_edits import edit_conversation
from server.api.messages_input import FORMAT_PARAMS, to_turn
from server.parsing import OutputItem
from server.pipeline.choices import ChoiceState, ItemEvent, ItemStream, choice_states, parsed_updates
from server.api.protocol import APIError
from server.cache.session import claude_code_session

Event = tuple[str, dict[str, Any]]  # (event name, payload)


def plan_messages(
    ctx: ServingContext, req: MessagesRequest, body: dict[str, Any], cache_salt: str | None,
    headers: Mapping[str, str],
) -> Plan:
    edited = edit_conversation(ctx, req, cache_salt)  # `context_management`, before rendering
    turn = to_turn(edited.conversation, ctx.family, claude_code_session(headers, req.metadata))
    if req.context_management is not None:
        turn = replace(turn, context_edits=tuple(edited.applied))
    try:
        return plan_turn(ctx, turn, body, cache_salt, int(time.time()), endpoint="messages", id_prefix="msg")
    except APIError as exc:
        raise exc.renamed(FORMAT_PARAMS) from None


def count_tokens(ctx: ServingContext, req: CountTokensRequest, cache_salt: str | None) -> dict[str, Any]:
    """The prompt's length in tokens, rendered exactly as `/v1/messages` renders it (its `context_management`
    edits applied: then also `context_management.original_input_tokens`, the length before them)."""
    ctx.check_model(req.model)
    edited = edit_conversation(ctx, req, cache_salt)
    turn = with_cached_content(ctx, to_turn(edited.conversation, ctx.family), cache_salt)
    turn, images = turn_images(ctx.images, turn)  # an image counts its tokens
    tokens = len(expand(ctx.images, ctx.encode(render_turn(ctx, turn)), images).token_ids)
    counted: dict[str, Any] = {"input_tokens": tokens}
    if req.context_management is not None:
        counted["context_management"] = {"original_input_tokens": edited.original_tokens}
    return counted


def _block(item: OutputItem, streamed: bool = False) -> dict[str, Any]:
    """An output item as a content block: whole, or as `content_block_start` opens it (``streamed``)."""
    text = "" if streamed else item.text
    if item.kind == "call":
        return {"type": "tool_use", "id": item.call_id, "name": item.name, "input": {} if streamed else
                _json_object(item.text)}
    if item.kind == "reasoning":
        return {"type": "thinking", "thinking": text, "signature": ""}
    return {"type": "text", "text": text}


_DELTA_FIELDS = {"text": ("text_delta", "text"), "reasoning": ("thinking_delta", "thinking"),
                 "arguments": ("input_json_delta", "partial_json")}


def _block_event(event: ItemEvent) -> Event:
    if event.kind == "start":
        return "content_block_start", {"index": event.index, "content_block": _block(event.item, streamed=True)}
    if event.kind == "stop":
        return "content_block_stop", {"index": event.index}
    assert event.delta is not None
    kind, field = _DELTA_FIELDS[event.delta.kind]
    return "content_block_delta", {"index": event.index, "delta": {"type": kind, field: event.delta.text}}


def _json_object(text: str) -> dict[str, Any]:
    """A tool call's input; arguments that are not a JSON object (output cut off mid-call) give {}."""
    try:
        value = json_text.loads(text) if text.strip() else {}
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _message(ctx: ServingContext, plan: Plan, content: list[dict], state: ChoiceState | None) -> dict[str, Any]:
    reason, sequence = state.finish(plan.turn.sampling.max_tokens).anthropic() if state else (None, None)
    return {
        "id": plan.request_id, "type": "message", "role": "assistant", "model": ctx.model_name, "content": content,
        "stop_reason": reason, "stop_sequence": sequence, "usage": _usage(ctx, plan, state),
        **_context_management(plan),
    }


def _context_management(plan: Plan) -> dict[str, Any]:
    """What the request's `context_management` cleared ({} when it asked for none)."""
    edits = plan.turn.context_edits
    return {} if edits is None else {"context_management": {"applied_edits": list(edits)}}


def _usage(ctx: ServingContext, plan: Plan, state: ChoiceState | None) -> dict[str, int]:
    usage = Usage.of([plan.generation], state.num_tokens if state else 0)
    # what the engine really retained (its cap or the tenant's share may refuse a pin), never more than asked
    pinned = min(plan.pinned_tokens, plan.generation.num_pinned_tokens)
    return usage.anthropic(pinned, ctx.engine.facts.block_size)


async def complete_messages(ctx: ServingContext, plan: Plan, stream: RequestStream) -> dict[str, Any]:
    [state] = states = choice_states(ctx, plan, streaming=False)
    try:
        async for _ in parsed_updates(ctx, plan, stream, states):
            pass
    finally:
        record_plan(ctx, plan)
    return _message(ctx, plan, [_block(item) for item in state.items], state)


async def stream_messages(ctx: ServingContext, plan: Plan, stream: RequestStream) -> AsyncIterator[str]:
    """`message_start` waits for the first output, which says how much of the prompt came from the cache."""
    [state] = states = choice_states(ctx, plan, streaming=True)
    blocks = ItemStream(state)
    started = False
    try:
        async for update in parsed_updates(ctx, plan, stream, states):
            if not started:
                started = True
                yield anthropic_sse("message_start", {"message": _message(ctx, plan, [], None)})
                yield anthropic_sse("ping", {})
            for delta in update.deltas:
                for item_event in blocks.add(delta):
                    yield anthropic_sse(*_block_event(item_event))
    finally:
        record_plan(ctx, plan)
    for item_event in blocks.close():
        yield anthropic_sse(*_block_event(item_event))
    reason, sequence = state.finish(plan.turn.sampling.max_tokens).anthropic()
    yield anthropic_sse("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                          "usage": _usage(ctx, plan, state), **_context_management(plan)})
    yield anthropic_sse("message_stop", {})
