"""`POST /v1/responses` (OpenAI Responses, for Codex): a thin adapter over the chat pipeline. The request becomes a
chat request (server/api/responses_input.py); the parsed deltas become output items (`reasoning`, `message`,
`function_call`), one JSON response or SSE events in the official order: `response.created`,
`response.in_progress`, per item `response.output_item.added` (+ `response.content_part.added` for text), its deltas
(`response.reasoning_text.delta`, `response.output_text.delta`, `response.function_call_arguments.delta`) and
`.done` events, `response.output_item.done`, then `response.completed` (or `response.incomplete` at the token limit).
"""
from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from server.pipeline.async_engine import RequestStream
from server.api.chat import ChatPlan, plan_chat, record_plan
from server.pipeline.context import ServingContext
from server.pipeline.generation import Usage
from server.parsing import Delta, OutputItem
from server.pipeline.choices import ChoiceState, ItemEvent, ItemStream, choice_states, parsed_updates
from server.api.protocol import APIError
from server.api.responses_input import FORMAT_PARAMS, ResponseStore, to_turn
from server.api.responses_protocol import ResponsesRequest, responses_sse
from server.cache.session import prompt_cache_key_session

Event = dict[str, Any]
_ITEM_TYPES = {"text": "message", "reasoning": "reasoning", "call": "function_call"}
_ID_PREFIXES = {"text": "msg", "reasoning": "rs", "call": "fc"}


@dataclass
class ResponsePlan:
    chat: ChatPlan
    req: ResponsesRequest
    tool_names: dict[str, tuple[str | None, str]]  # flat name -> (namespace, name)
    history: list[dict]  # the conversation before this turn's output (chat messages, without instructions)


def plan_response(
    ctx: ServingContext, req: ResponsesRequest, body: dict[str, Any], cache_salt: str | None, store: ResponseStore,
    headers: Mapping[str, str],
) -> ResponsePlan:
    previous = store.history(cache_salt, req.previous_response_id) if req.previous_response_id else []
    turn, names = to_turn(req, ctx.family, previous, prompt_cache_key_session(req.prompt_cache_key, headers))
    try:
        plan = plan_chat(ctx, turn, body, cache_salt, int(time.time()), endpoint="responses", id_prefix="resp")
    except APIError as exc:
        raise exc.renamed(FORMAT_PARAMS) from None
    history = turn.messages[1:] if req.instructions else turn.messages
    return ResponsePlan(plan, req, names, history)


class ResponseItems:
    """The response's output items in Responses' shape, from a choice's items: whole, or as stream events."""

    def __init__(self, state: ChoiceState, tool_names: dict[str, tuple[str | None, str]],
                 with_encrypted_reasoning: bool) -> None:
        self._state = state
        self._stream = ItemStream(state)
        self._tool_names = tool_names
        self._with_encrypted_reasoning = with_encrypted_reasoning
        self._ids: list[str] = []  # per item, as its first event named it

    def output(self) -> list[dict[str, Any]]:
        """Every item, completed (the output has ended)."""
        return [self._json(i, item, "completed") for i, item in enumerate(self._state.items)]

    def add(self, delta: Delta) -> list[Event]:
        return [event for item_event in self._stream.add(delta) for event in self._events(item_event)]

    def close(self) -> list[Event]:
        return [event for item_event in self._stream.close() for event in self._events(item_event)]

    def _id(self, index: int, item: OutputItem) -> str:
        while len(self._ids) <= index:
            self._ids.append(f"{_ID_PREFIXES[item.kind]}_{secrets.token_hex(12)}")
        return self._ids[index]

    def _json(self, index: int, item: OutputItem, status: str, text: str | None = None) -> dict[str, Any]:
        """The item as Responses shows it; ``text``: instead of the item's own (empty as it starts)."""
        text = item.text if text is None else text
        out: dict[str, Any] = {"id": self._id(index, item), "type": _ITEM_TYPES[item.kind], "status": status}
        if item.kind == "call":
            namespace, name = self._tool_names.get(item.name, (None, item.name))
            out.update(call_id=item.call_id, name=name, arguments=text)
            if namespace:
                out["namespace"] = namespace
        elif item.kind == "reasoning":
            out.update(summary=[], content=[{"type": "reasoning_text", "text": text}])
            if status == "completed" and self._with_encrypted_reasoning:
                out["encrypted_content"] = text  # opaque to the client, which sends it back next turn
        else:
            out.update(role="assistant", content=[{"type": "output_text", "text": text, "annotations": []}])
        return out

    def _events(self, event: ItemEvent) -> list[Event]:
        item, index = event.item, event.index
        at = {"item_id": self._id(index, item), "output_index": index}
        if event.kind == "start":
            added = self._json(index, item, "in_progress", text="")
            if item.kind != "text":
                return [{"type": "response.output_item.added", "output_index": index, "item": added}]
            return [{"type": "response.output_item.added", "output_index": index, "item": {**added, "content": []}},
                    {"type": "response.content_part.added", **at, "content_index": 0,
                     "part": {"type": "output_text", "text": "", "annotations": []}}]
        if event.kind == "delta":
            assert event.delta is not None
            if item.kind == "call":
                return [{"type": "response.function_call_arguments.delta", **at, "delta": event.delta.text}]
            name = "response.output_text.delta" if item.kind == "text" else "response.reasoning_text.delta"
            return [{"type": name, **at, "content_index": 0, "delta": event.delta.text}]
        done = self._json(index, item, "completed")
        if item.kind == "text":
            part = done["content"][0]
            events = [{"type": "response.output_text.done", **at, "content_index": 0, "text": part["text"]},
                      {"type": "response.content_part.done", **at, "content_index": 0, "part": part}]
        elif item.kind == "reasoning":
            events = [{"type": "response.reasoning_text.done", **at, "content_index": 0, "text": item.text}]
        else:
            events = [{"type": "response.function_call_arguments.done", **at, "name": done["name"],
                       "arguments": item.text}]
        return [*events, {"type": "response.output_item.done", "output_index": index, "item": done}]


def _response(ctx: ServingContext, plan: ResponsePlan, items: list[dict], state: ChoiceState | None) -> dict:
    req = plan.req
    status = "in_progress" if state is None else state.finish(req.max_output_tokens).responses_status()
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {
        "id": plan.chat.request_id, "object": "response", "created_at": plan.chat.created, "status": status,
        "model": ctx.model_name, "output": items, "incomplete_details": incomplete, "error": None,
        "instructions": req.instructions, "tools": req.tools or [], "tool_choice": req.tool_choice or "auto",
        "parallel_tool_calls": req.parallel_tool_calls is not False, "previous_response_id": req.previous_response_id,
        "max_output_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
        "reasoning": req.reasoning, "store": req.store, "metadata": req.metadata or {},
        "prompt_cache_key": req.prompt_cache_key, "text": {"format": {"type": "text"}, **(req.text or {})},
        "truncation": "disabled",
        "usage": None if state is None else Usage.of([plan.chat.prompt], state.num_tokens).responses(),
    }


def _items(plan: ResponsePlan, state: ChoiceState) -> ResponseItems:
    return ResponseItems(state, plan.tool_names, "reasoning.encrypted_content" in (plan.req.include or []))


async def _run(ctx: ServingContext, plan: ResponsePlan, stream: RequestStream, items: ResponseItems,
               states: list[ChoiceState]) -> AsyncIterator[Event]:
    try:
        async for update in parsed_updates(ctx, plan.chat, stream, states):
            for delta in update.deltas:
                for event in items.add(delta):
                    yield event
    finally:
        record_plan(ctx, plan.chat)
    for event in items.close():
        yield event


def _remember(plan: ResponsePlan, state: ChoiceState, store: ResponseStore) -> None:
    if plan.req.store:
        store.put(plan.chat.prompt.request.cache_salt, plan.chat.request_id, [*plan.history, state.message()])


async def complete_response(
    ctx: ServingContext, plan: ResponsePlan, stream: RequestStream, store: ResponseStore
) -> dict[str, Any]:
    [state] = states = choice_states(ctx, plan.chat, streaming=False)
    try:
        async for _ in parsed_updates(ctx, plan.chat, stream, states):
            pass
    finally:
        record_plan(ctx, plan.chat)
    _remember(plan, state, store)
    return _response(ctx, plan, _items(plan, state).output(), state)


async def stream_response(
    ctx: ServingContext, plan: ResponsePlan, stream: RequestStream, store: ResponseStore
) -> AsyncIterator[str]:
    [state] = states = choice_states(ctx, plan.chat, streaming=True)
    items = _items(plan, state)
    sequence = 0

    def sse(event: Event) -> str:
        nonlocal sequence
        sequence += 1
        return responses_sse({**event, "sequence_number": sequence - 1})

    yield sse({"type": "response.created", "response": _response(ctx, plan, [], None)})
    yield sse({"type": "response.in_progress", "response": _response(ctx, plan, [], None)})
    async for event in _run(ctx, plan, stream, items, states):
        yield sse(event)
    _remember(plan, state, store)
    final = _response(ctx, plan, items.output(), state)
    yield sse({"type": f"response.{final['status']}", "response": final})
