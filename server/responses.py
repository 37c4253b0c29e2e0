"""`POST /v1/responses` (OpenAI Responses, for Codex): a thin adapter over the chat pipeline. The request becomes a
chat request (server/responses_input.py); the parsed deltas become output items (`reasoning`, `message`,
`function_call`), one JSON response or SSE events in the official order: `response.created`,
`response.in_progress`, per item `response.output_item.added` (+ `response.content_part.added` for text), its deltas
(`response.reasoning_text.delta`, `response.output_text.delta`, `response.function_call_arguments.delta`) and
`.done` events, `response.output_item.done`, then `response.completed` (or `response.incomplete` at the token limit).
"""
from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from server.async_engine import RequestStream
from server.chat import ChatPlan, plan_chat, record_plan
from server.pipeline import ChoiceState, Delta, choice_states, parsed_updates
from server.context import ServingContext
from server.generation import Usage
from server.protocol import APIError
from server.responses_input import FORMAT_PARAMS, ResponseStore, to_chat_request
from server.responses_protocol import ResponsesRequest, responses_sse
from server.session import prompt_cache_key_session

Event = dict[str, Any]
_ITEM_TYPES = {"text": "message", "reasoning": "reasoning", "call": "function_call", "arguments": "function_call"}
_ID_PREFIXES = {"message": "msg", "reasoning": "rs", "function_call": "fc"}


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
    chat, names = to_chat_request(req, ctx.family, previous)
    try:
        plan = plan_chat(ctx, chat, body, cache_salt, int(time.time()), session=prompt_cache_key_session(
            req.prompt_cache_key, headers), endpoint="responses", id_prefix="resp")
    except APIError as exc:
        raise exc.renamed(FORMAT_PARAMS) from None
    history = chat.messages[1:] if req.instructions else chat.messages
    return ResponsePlan(plan, req, names, history)


@dataclass
class OutputItems:
    """The response's output items, built from parsed deltas; `add` returns the stream events for each delta."""

    tool_names: dict[str, tuple[str | None, str]]
    with_encrypted_reasoning: bool
    items: list[dict[str, Any]] = field(default_factory=list)
    _open: bool = False

    def add(self, delta: Delta) -> list[Event]:
        kind = _ITEM_TYPES[delta.kind]
        events = []
        if delta.kind == "call" or not self._open or self.items[-1]["type"] != kind:
            events += self.close()
            events += self._start(delta, kind)
        if delta.kind != "call":
            events.append(self._grow(delta))
        return events

    def close(self) -> list[Event]:
        if not self._open:
            return []
        self._open = False
        item, at = self.items[-1], self._at()
        item["status"] = "completed"
        if item["type"] == "message":
            part = item["content"][0]
            events = [{"type": "response.output_text.done", **at, "content_index": 0, "text": part["text"]},
                      {"type": "response.content_part.done", **at, "content_index": 0, "part": part}]
        elif item["type"] == "reasoning":
            text = item["content"][0]["text"]
            if self.with_encrypted_reasoning:
                item["encrypted_content"] = text  # opaque to the client, which sends it back next turn
            events = [{"type": "response.reasoning_text.done", **at, "content_index": 0, "text": text}]
        else:
            events = [{"type": "response.function_call_arguments.done", **at, "name": item["name"],
                       "arguments": item["arguments"]}]
        return [*events, {"type": "response.output_item.done", "output_index": len(self.items) - 1, "item": item}]

    def _at(self) -> dict[str, Any]:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}

    def _start(self, delta: Delta, kind: str) -> list[Event]:
        item: dict[str, Any] = {"id": f"{_ID_PREFIXES[kind]}_{secrets.token_hex(12)}", "type": kind,
                                "status": "in_progress"}
        if kind == "function_call":
            namespace, name = self.tool_names.get(delta.text, (None, delta.text))
            item.update(call_id=delta.call_id, name=name, arguments="")
            if namespace:
                item["namespace"] = namespace
        elif kind == "reasoning":
            item.update(summary=[], content=[{"type": "reasoning_text", "text": ""}])
        else:
            item.update(role="assistant", content=[{"type": "output_text", "text": "", "annotations": []}])
        self.items.append(item)
        self._open = True
        events = [{"type": "response.output_item.added", "output_index": len(self.items) - 1,
                   "item": {**item, "content": []} if kind == "message" else dict(item)}]
        if kind == "message":
            events.append({"type": "response.content_part.added", **self._at(), "content_index": 0,
                           "part": {"type": "output_text", "text": "", "annotations": []}})
        return events

    def _grow(self, delta: Delta) -> Event:
        item = self.items[-1]
        if delta.kind == "arguments":
            item["arguments"] += delta.text
            return {"type": "response.function_call_arguments.delta", **self._at(), "delta": delta.text}
        item["content"][0]["text"] += delta.text
        name = "response.output_text.delta" if delta.kind == "text" else "response.reasoning_text.delta"
        return {"type": name, **self._at(), "content_index": 0, "delta": delta.text}


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
        "usage": None if state is None else Usage.of([plan.chat.prompt], len(state.choice.token_ids)).responses(),
    }


def _items(plan: ResponsePlan) -> OutputItems:
    return OutputItems(plan.tool_names, "reasoning.encrypted_content" in (plan.req.include or []))


async def _run(ctx: ServingContext, plan: ResponsePlan, stream: RequestStream, items: OutputItems,
               state: list[ChoiceState]) -> AsyncIterator[Event]:
    try:
        async for update in parsed_updates(ctx, plan.chat, stream, state):
            for delta in update.deltas:
                for event in items.add(Delta.of(delta)):
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
    items = _items(plan)
    async for _ in _run(ctx, plan, stream, items, states):
        pass
    _remember(plan, state, store)
    return _response(ctx, plan, items.items, state)


async def stream_response(
    ctx: ServingContext, plan: ResponsePlan, stream: RequestStream, store: ResponseStore
) -> AsyncIterator[str]:
    [state] = states = choice_states(ctx, plan.chat, streaming=True)
    items = _items(plan)
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
    final = _response(ctx, plan, items.items, state)
    yield sse({"type": f"response.{final['status']}", "response": final})
