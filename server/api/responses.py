"""`POST /v1/responses` (OpenAI Responses, for Codex): a thin adapter over the chat pipeline. The request becomes a
chat request (server/api/responses_input.py); the parsed deltas become output items (`reasoning`, `message`,
`function_call`), one JSON response or SSE events in the official order: `response.created`,
`response.in_progress`, per item `response.output_item.added` (+ `response.content_part.added` for text), its deltas
(`response.reasoning_text.delta`, `response.output_text.delta`, `response.function_call_arguments.delta`) and
`.done` events, `response.output_item.done`, then `response.completed` (or `response.incomplete` at the token limit).

A request whose input ends with a `compaction_trigger` runs the summary turn instead (server/api/compaction.py) and
answers with exactly one `compaction` item; `POST /v1/responses/compact` (`compact_response`) answers with the
conversation's user messages and that item, as one `response.compaction` object.
"""
from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from server.pipeline.async_engine import RequestStream
from server.pipeline.plan import Plan, plan_turn, record_plan
from server.pipeline.context import ServingContext
from server.pipeline.generation import Usage
from server.parsing import Delta, OutputItem
from server.pipeline.choices import ChoiceState, ItemEvent, ItemStream, choice_states, parsed_updates
from server.api.compaction import (
    COMPACTION_PROMPT,
    SUMMARY_MAX_TOKENS,
    CompactionSealer,
    Summary,
    compaction_item,
    has_trigger,
    retained_user_messages,
    summary_message,
)
from server.api.protocol import APIError
from server.api.responses_input import FORMAT_PARAMS, ResponseStore, to_turn
from server.api.responses_protocol import ResponsesRequest, responses_sse
from server.cache.cache_salt import salt_tenant
from server.cache.session import prompt_cache_key_session

Event = dict[str, Any]
_ITEM_TYPES = {"text": "message", "reasoning": "reasoning", "call": "function_call"}
_ID_PREFIXES = {"text": "msg", "reasoning": "rs", "call": "fc"}


@dataclass
class Compaction:
    """A summary turn's answer: the items it returns before its `compaction` item (`/v1/responses/compact`'s user
    messages), and how the summary is sealed."""

    sealer: CompactionSealer
    tenant: str | None
    epoch: int  # the epoch the summary starts
    kept: list[dict] = field(default_factory=list)

    def items(self, state: ChoiceState) -> list[dict]:
        text = state.message()["content"] or state.output.text
        return [*self.kept, compaction_item(self.sealer.seal(self.tenant, Summary(text, self.epoch)))]


@dataclass
class ResponsePlan:
    chat: Plan
    req: ResponsesRequest
    tool_names: dict[str, tuple[str | None, str]]  # flat name -> (namespace, name)
    history: list[dict]  # the conversation before this turn's output (chat messages, without instructions)
    compaction: Compaction | None = None  # a summary turn (compaction_trigger, /v1/responses/compact)


def plan_response(
    ctx: ServingContext, req: ResponsesRequest, body: dict[str, Any], cache_salt: str | None, store: ResponseStore,
    headers: Mapping[str, str], sealer: CompactionSealer, compact: bool = False,
) -> ResponsePlan:
    """The request's plan; with ``compact`` (or a `compaction_trigger` ending its input) the plan of its summary
    turn: the same conversation, so the same cached prompt, and one more user message asking for the summary."""
    previous = store.history(cache_salt, req.previous_response_id) if req.previous_response_id else []
    tenant = salt_tenant(cache_salt)
    epochs = [0]

    def expand(item: dict, where: str) -> dict:
        summary = sealer.open(tenant, item.get("encrypted_content"), f"{where}.encrypted_content")
        epochs.append(summary.epoch)
        return summary_message(summary)

    triggered = has_trigger(req.input)
    asked = req.model_copy(update={"input": req.input[:-1]}) if triggered else req
    turn, names = to_turn(asked, ctx.family, previous, prompt_cache_key_session(req.prompt_cache_key, headers), expand)
    turn = replace(turn, compaction_epoch=max(epochs))
    compaction = None
    if compact or triggered:
        compaction = Compaction(sealer, tenant, max(epochs) + 1, retained_user_messages(asked.input) if compact else [])
        turn = replace(turn, messages=[*turn.messages, {"role": "user", "content": COMPACTION_PROMPT}],
                       tool_choice="none", response_format=None,
                       sampling=replace(turn.sampling, max_tokens=req.max_output_tokens or SUMMARY_MAX_TOKENS))
    try:
        plan = plan_turn(ctx, turn, body, cache_salt, int(time.time()), endpoint="responses", id_prefix="resp")
    except APIError as exc:
        raise exc.renamed(FORMAT_PARAMS) from None
    history = turn.messages[1:] if req.instructions else turn.messages
    return ResponsePlan(plan, req, names, history, compaction)


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
    if state is not None and plan.compaction is not None:
        status = "completed"  # a summary cut at its limit is still the summary (Codex fails a turn otherwise)
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
        "usage": None if state is None else Usage.of([plan.chat.generation], state.num_tokens,
                                                     plan.chat.reasoning_tokens()).responses(),
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
    if plan.compaction is None:  # a summary turn continues nothing: its items are the conversation's state
        store.remember(plan.chat.generation.request.cache_salt, plan.chat.request_id, [*plan.history, state.message()],
                       stored=bool(plan.req.store))


async def complete_response(
    ctx: ServingContext, plan: ResponsePlan, stream: RequestStream, store: ResponseStore
) -> dict[str, Any]:
    state = await _finished_state(ctx, plan, stream)
    _remember(plan, state, store)
    output = plan.compaction.items(state) if plan.compaction else _items(plan, state).output()
    return _response(ctx, plan, output, state)


async def _finished_state(ctx: ServingContext, plan: ResponsePlan, stream: RequestStream) -> ChoiceState:
    """The choice, once its output has ended."""
    [state] = states = choice_states(ctx, plan.chat, streaming=False)
    try:
        async for _ in parsed_updates(ctx, plan.chat, stream, states):
            pass
    finally:
        record_plan(ctx, plan.chat)
    return state


async def compact_response(ctx: ServingContext, plan: ResponsePlan, stream: RequestStream) -> dict[str, Any]:
    """`POST /v1/responses/compact`: the conversation's user messages and one `compaction` item."""
    assert plan.compaction is not None
    state = await _finished_state(ctx, plan, stream)
    return {"id": plan.chat.request_id, "object": "response.compaction", "created_at": plan.chat.created,
            "output": plan.compaction.items(state),
            "usage": Usage.of([plan.chat.generation], state.num_tokens, plan.chat.reasoning_tokens()).responses()}


async def stream_response(
    ctx: ServingContext, plan: ResponsePlan, stream: RequestStream, store: ResponseStore
) -> AsyncIterator[str]:
    """The response as SSE events."""
    async for event in response_events(ctx, plan, stream, store):
        yield responses_sse(event)


async def response_events(
    ctx: ServingContext, plan: ResponsePlan, stream: RequestStream, store: ResponseStore
) -> AsyncIterator[Event]:
    """The response's events in the official order, numbered (`sequence_number`): over SSE or a WebSocket."""
    [state] = states = choice_states(ctx, plan.chat, streaming=True)
    items = _items(plan, state)
    sequence = 0

    def numbered(event: Event) -> Event:
        nonlocal sequence
        sequence += 1
        return {**event, "sequence_number": sequence - 1}

    yield numbered({"type": "response.created", "response": _response(ctx, plan, [], None)})
    yield numbered({"type": "response.in_progress", "response": _response(ctx, plan, [], None)})
    if plan.compaction is not None:  # the summary is sealed whole: its item is added and done at the end
        state = await _finished_state(ctx, plan, stream)
        output = plan.compaction.items(state)
        for index, item in enumerate(output):
            yield numbered({"type": "response.output_item.added", "output_index": index, "item": item})
            yield numbered({"type": "response.output_item.done", "output_index": index, "item": item})
    else:
        async for event in _run(ctx, plan, stream, items, states):
            yield numbered(event)
        output = items.output()
    _remember(plan, state, store)
    final = _response(ctx, plan, output, state)
    yield numbered({"type": f"response.{final['status']}", "response": final})


async def prefill_events(ctx: ServingContext, plan: ResponsePlan, stream: RequestStream,
                         store: ResponseStore) -> AsyncIterator[Event]:
    """A warm-up's events (`generate: false` over a WebSocket): its prompt prefilled into the cache (the plan asks
    for one token, which is dropped), then `response.created` and `response.completed` with no output. A later
    request can continue it (`previous_response_id`: its conversation, nothing added)."""
    state = await _finished_state(ctx, plan, stream)
    store.remember(plan.chat.generation.request.cache_salt, plan.chat.request_id, plan.history,
                   stored=bool(plan.req.store))
    final = {**_response(ctx, plan, [], state), "status": "completed"}
    final["usage"] = Usage.of([plan.chat.generation], 0).responses()
    yield {"type": "response.created", "response": _response(ctx, plan, [], None), "sequence_number": 0}
    yield {"type": "response.completed", "response": final, "sequence_number": 1}
