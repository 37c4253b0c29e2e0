"""`POST /v1/messages` (Anthropic Messages, for Claude Code) and `POST /v1/messages/count_tokens`: a thin adapter over
the chat pipeline. The request becomes a chat request (server/api/messages_input.py); the parsed deltas become content
blocks (`text`, `thinking`, `tool_use`), one JSON message or Anthropic's SSE events:

`message_start`, `ping`, then per block `content_block_start` / `content_block_delta` (`text_delta`,
`thinking_delta`, `input_json_delta` as the arguments are generated) / `content_block_stop`, then `message_delta`
(stop reason, usage) and `message_stop`.

With Anthropic's server-side compaction due (`compact_20260112`, server/api/messages_compaction.py) the request runs
the summary turn first: the response starts with the `compaction` block (streamed as `content_block_start`, one
`compaction_delta` with the whole summary, `content_block_stop`), then the reply's blocks, generated over the
compacted conversation in the same request (or, with `pause_after_compaction`, `stop_reason: "compaction"`).
"""
from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from server import json_text
from server.api.anthropic_protocol import Conversation, CountTokensRequest, MessagesRequest, anthropic_sse
from server.api.compaction import continue_after, finished_state, summary_text
from server.api.messages_compaction import (
    STOP_REASON,
    Compact,
    compacted,
    iteration,
    summary_block,
    summary_max_tokens,
    summary_turn,
)
from server.pipeline.async_engine import RequestStream
from server.pipeline.plan import Plan, plan_turn, record_plan, with_cached_content
from server.pipeline.context import ServingContext
from server.pipeline.generation import Usage
from server.api.context_edits import edit_conversation, turn_tokens
from server.api.messages_input import FORMAT_PARAMS, to_turn
from server.parsing import OutputItem
from server.pipeline.choices import ChoiceState, ItemEvent, ItemStream, choice_states, parsed_updates
from server.api.protocol import APIError
from server.cache.session import claude_code_session

Event = tuple[str, dict[str, Any]]  # (event name, payload)


@dataclass
class Compaction:
    """A compaction due in this request: its edit, and the plan of the reply from the summary's text."""

    compact: Compact
    reply: Callable[[str], Plan]


@dataclass
class MessagesPlan:
    chat: Plan  # what runs first: the reply, or the summary turn of a compaction
    compaction: Compaction | None = None


def plan_messages(
    ctx: ServingContext, req: MessagesRequest, body: dict[str, Any], cache_salt: str | None,
    headers: Mapping[str, str],
) -> MessagesPlan:
    edited = edit_conversation(ctx, req, cache_salt)  # `context_management`, before rendering
    session = claude_code_session(headers, req.metadata)
    applied = tuple(edited.applied) if req.context_management is not None else None

    def plan(conversation: Conversation, epoch: int, summary: Compact | None = None) -> Plan:
        turn = replace(to_turn(conversation, ctx.family, session), context_edits=applied, compaction_epoch=epoch)
        if summary is not None:  # a summary: text only, whatever the reply may be
            turn = replace(turn, tool_choice="none", response_format=None, sampling=replace(
                turn.sampling, max_tokens=summary_max_tokens(req.max_tokens), stop=()))
        try:
            return plan_turn(ctx, turn, body, cache_salt, int(time.time()), endpoint="messages", id_prefix="msg")
        except APIError as exc:
            raise exc.renamed(FORMAT_PARAMS) from None

    compact = edited.compact
    if compact is None or edited.tokens < compact.trigger_tokens:
        return MessagesPlan(plan(edited.conversation, edited.epoch))
    return MessagesPlan(plan(summary_turn(edited.conversation, compact), edited.epoch, compact), Compaction(
        compact, lambda text: plan(compacted(edited.conversation, text), edited.epoch + bool(text))))


def count_tokens(ctx: ServingContext, req: CountTokensRequest, cache_salt: str | None) -> dict[str, Any]:
    """The prompt's length in tokens, rendered exactly as `/v1/messages` renders it (its `context_management`
    edits applied: then also `context_management.original_input_tokens`, the length before them)."""
    ctx.check_model(req.model)
    edited = edit_conversation(ctx, req, cache_salt)
    turn = with_cached_content(ctx, to_turn(edited.conversation, ctx.family), cache_salt)
    counted: dict[str, Any] = {"input_tokens": turn_tokens(ctx, turn)}
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


def _block_event(event: ItemEvent, first_index: int = 0) -> Event:
    index = first_index + event.index
    if event.kind == "start":
        return "content_block_start", {"index": index, "content_block": _block(event.item, streamed=True)}
    if event.kind == "stop":
        return "content_block_stop", {"index": index}
    assert event.delta is not None
    kind, field = _DELTA_FIELDS[event.delta.kind]
    return "content_block_delta", {"index": index, "delta": {"type": kind, field: event.delta.text}}


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


def _compacted_usage(ctx: ServingContext, summary: tuple[Plan, ChoiceState],
                     reply: tuple[Plan, ChoiceState] | None) -> dict[str, Any]:
    """The reply's usage (zero without one: paused), and `iterations`: the summary turn's, then the reply's."""
    compaction = _usage(ctx, *summary)
    top = _usage(ctx, *reply) if reply else {k: 0 for k in compaction}
    iterations = [iteration("compaction", compaction)] + ([iteration("message", top)] if reply else [])
    return {**top, "iterations": iterations}


def _context_management(plan: Plan) -> dict[str, Any]:
    """What the request's `context_management` cleared ({} when it asked for none)."""
    edits = plan.turn.context_edits
    return {} if edits is None else {"context_management": {"applied_edits": list(edits)}}


def _usage(ctx: ServingContext, plan: Plan, state: ChoiceState | None) -> dict[str, int]:
    usage = Usage.of([plan.generation], state.num_tokens if state else 0)
    # what the engine really retained (its cap or the tenant's share may refuse a pin), never more than asked
    pinned = min(plan.pinned_tokens, plan.generation.num_pinned_tokens)
    return usage.anthropic(pinned, ctx.engine.facts.block_size)


async def complete_messages(ctx: ServingContext, plan: MessagesPlan, stream: RequestStream) -> dict[str, Any]:
    state = await finished_state(ctx, plan.chat, stream)
    if plan.compaction is None:
        return _message(ctx, plan.chat, [_block(item) for item in state.items], state)
    compaction, summary = plan.compaction, summary_text(state)
    block = summary_block(summary)
    if compaction.compact.pause:
        return {**_message(ctx, plan.chat, [block], state), "stop_reason": STOP_REASON, "stop_sequence": None,
                "usage": _compacted_usage(ctx, (plan.chat, state), None)}
    reply, reply_stream = await continue_after(ctx, stream, lambda: compaction.reply(summary), lambda p: p.generation)
    reply_state = await finished_state(ctx, reply, reply_stream)
    message = _message(ctx, reply, [block, *(_block(item) for item in reply_state.items)], reply_state)
    return {**message, "id": plan.chat.request_id,
            "usage": _compacted_usage(ctx, (plan.chat, state), (reply, reply_state))}


async def stream_messages(ctx: ServingContext, plan: MessagesPlan, stream: RequestStream) -> AsyncIterator[str]:
    """`message_start` waits for the first output, which says how much of the prompt came from the cache (with a
    compaction: for the summary turn to end)."""
    head = plan.chat

    def start() -> list[str]:
        return [anthropic_sse("message_start", {"message": _message(ctx, head, [], None)}), anthropic_sse("ping", {})]

    if plan.compaction is None:
        [state] = states = choice_states(ctx, head, streaming=True)
        async for event in _reply_events(ctx, head, stream, states, 0, start):
            yield event
        reason, sequence = state.finish(head.turn.sampling.max_tokens).anthropic()
        usage: dict[str, Any] = _usage(ctx, head, state)
        last = head
    else:
        compaction = plan.compaction
        summary_state = await finished_state(ctx, head, stream)
        for event in start():
            yield event
        summary = summary_text(summary_state)
        yield anthropic_sse("content_block_start", {"index": 0, "content_block": {"type": "compaction",
                                                                                   "content": None}})
        if summary:
            yield anthropic_sse("content_block_delta", {"index": 0, "delta": {"type": "compaction_delta",
                                                                               "content": summary}})
        yield anthropic_sse("content_block_stop", {"index": 0})
        last, reason, sequence = head, STOP_REASON, None
        usage = _compacted_usage(ctx, (head, summary_state), None)
        if not compaction.compact.pause:
            last, reply_stream = await continue_after(ctx, stream, lambda: compaction.reply(summary),
                                                      lambda p: p.generation)
            [state] = states = choice_states(ctx, last, streaming=True)
            async for event in _reply_events(ctx, last, reply_stream, states, 1, None):
                yield event
            reason, sequence = state.finish(last.turn.sampling.max_tokens).anthropic()
            usage = _compacted_usage(ctx, (head, summary_state), (last, state))
    yield anthropic_sse("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                          "usage": usage, **_context_management(last)})
    yield anthropic_sse("message_stop", {})


async def _reply_events(ctx: ServingContext, plan: Plan, stream: RequestStream, states: list[ChoiceState],
                        first_index: int, start: Callable[[], list[str]] | None) -> AsyncIterator[str]:
    """A reply's content block events, its blocks numbered from ``first_index``; ``start``: the events that open the
    message, sent with the first output."""
    blocks = ItemStream(states[0])
    try:
        async for update in parsed_updates(ctx, plan, stream, states):
            if start is not None:
                for event in start():
                    yield event
                start = None
            for delta in update.deltas:
                for item_event in blocks.add(delta):
                    yield anthropic_sse(*_block_event(item_event, first_index))
    finally:
        record_plan(ctx, plan)
    for item_event in blocks.close():
        yield anthropic_sse(*_block_event(item_event, first_index))
