"""`POST /v1/responses` (OpenAI Responses, for Codex): a thin adapter over the chat pipeline. The request becomes a
chat request (server/api/responses_input.py); the parsed deltas become output items (`reasoning`, `message`,
`function_call`), one JSON response or SSE events in the official order: `response.created`,
`response.in_progress`, per item `response.output_item.added` (+ `response.content_part.added` for text), its deltas
(`response.reasoning_text.delta`, `response.output_text.delta`, `response.function_call_arguments.delta`) and
`.done` events, `response.output_item.done`, then `response.completed` (or `response.incomplete` at the token limit).

A request whose input ends with a `compaction_trigger` runs the summary turn instead (server/api/compaction.py) and
answers with exactly one `compaction` item; `POST /v1/responses/compact` (`compact_response`) answers with the
conversation's user messages and that item, as one `response.compaction` object. A request whose
`context_management` holds `{"type": "compaction", "compact_threshold": N}` and whose rendered input exceeds N
tokens is compacted automatically: the summary turn runs first, then the reply over the compacted input (the user
messages `/v1/responses/compact` keeps, then the item), in the same request; the output is the `compaction` item
followed by the reply's items, and the response stored for `previous_response_id` continues the compacted input.
"""
from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator, Callable, Mapping
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
    auto_compact_threshold,
    compaction_item,
    continue_after,
    finished_state,
    has_trigger,
    retained_user_messages,
    summary_message,
    summary_text,
)
from server.api.protocol import APIError
from server.api.responses_input import FORMAT_PARAMS, ResponseStore, to_turn
from server.api.responses_protocol import ResponsesRequest, responses_sse
from server.cache.cache_salt import salt_tenant
from server.cache.session import prompt_cache_key_session
from server.pipeline.turn import Turn

Event = dict[str, Any]
_ITEM_TYPES = {"text": "message", "reasoning": "reasoning", "call": "function_call"}
_ID_PREFIXES = {"text": "msg", "reasoning": "rs", "call": "fc"}


@dataclass
class Compaction:
    """A summary turn's answer: the items it returns before its `compaction` item (`/v1/responses/compact`'s user
    messages), how the summary is sealed, and (an automatic compaction) the plan of the reply that follows it."""

    sealer: CompactionSealer
    tenant: str | None
    epoch: int  # the epoch the summary starts
    kept: list[dict] = field(default_factory=list)
    then: Callable[[dict], ResponsePlan] | None = None  # the reply's plan, from the compaction item

    def item(self, state: ChoiceState) -> dict:
        return compaction_item(self.sealer.seal(self.tenant, Summary(summary_text(state), self.epoch)))

    def items(self, state: ChoiceState) -> list[dict]:
        return [*self.kept, self.item(state)]


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
    history = turn.messages[1:] if req.instructions else turn.messages

    def planned(turn: Turn) -> Plan:
        try:
            return plan_turn(ctx, turn, body, cache_salt, int(time.time()), endpoint="responses", id_prefix="resp")
        except APIError as exc:
            raise exc.renamed(FORMAT_PARAMS) from None

    def summary_turn() -> Turn:
        return replace(turn, messages=[*turn.messages, {"role": "user", "content": COMPACTION_PROMPT}],
                       tool_choice="none", response_format=None,
                       sampling=replace(turn.sampling, max_tokens=req.max_output_tokens or SUMMARY_MAX_TOKENS))

    if compact or triggered:
        compaction = Compaction(sealer, tenant, max(epochs) + 1, retained_user_messages(asked.input) if compact else [])
        return ResponsePlan(planned(summary_turn()), req, names, history, compaction)
    plan = planned(turn)
    threshold = auto_compact_threshold(req.context_management, ctx.max_model_len)
    if threshold is None or len(plan.generation.request.prompt_token_ids) <= threshold:
        return ResponsePlan(plan, req, names, history)
    kept = retained_user_messages(asked.input)

    def reply(item: dict) -> ResponsePlan:
        """The reply over the compacted input, as a client would send it next (never compacted again here)."""
        compacted = req.model_copy(update={"input": [*kept, item], "previous_response_id": None,
                                           "context_management": None})
        return plan_response(ctx, compacted, body, cache_salt, store, headers, sealer)

    compaction = Compaction(sealer, tenant, max(epochs) + 1, then=reply)
    return ResponsePlan(planned(summary_turn()), req, names, history, compaction)


class ResponseItems:
    """The response's output items in Responses' shape, from a choice's items: whole, or as stream events."""

    def __init__(self, state: ChoiceState, tool_names: dict[str, tuple[str | None, str]],
                 with_encrypted_reasoning: bool, first_index: int = 0) -> None:
        self._state = state
        self._first_index = first_index  # the output index of its first item (after a compaction item: 1)
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
        output_index = self._first_index + index
        at = {"item_id": self._id(index, item), "output_index": output_index}
        if event.kind == "start":
            added = self._json(index, item, "in_progress", text="")
            if item.kind != "text":
                return [{"type": "response.output_item.added", "output_index": output_index, "item": added}]
            return [{"type": "response.output_item.added", "output_index": output_index,
                     "item": {**added, "content": []}},
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
        return [*events, {"type": "response.output_item.done", "output_index": output_index, "item": done}]


def _response(ctx: ServingContext, plan: ResponsePlan, items: list[dict], state: ChoiceState | None,
              usage: Usage | None = None) -> dict:
    """``usage``: instead of the plan's own (an automatic compaction's: both generations')."""
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
        "usage": None if state is None else (usage or _usage(plan, state)).responses(),
    }


def _usage(plan: ResponsePlan, state: ChoiceState) -> Usage:
    return Usage.of([plan.chat.generation], state.num_tokens, plan.chat.reasoning_tokens())


def _both(first: tuple[ResponsePlan, ChoiceState], then: tuple[ResponsePlan, ChoiceState]) -> Usage:
    """An automatic compaction's usage: its summary turn's and its reply's, added up."""
    a, b = _usage(*first), _usage(*then)
    return Usage(a.prompt_tokens + b.prompt_tokens, a.cached_tokens + b.cached_tokens,
                 a.completion_tokens + b.completion_tokens, a.reasoning_tokens + b.reasoning_tokens)


def _items(plan: ResponsePlan, state: ChoiceState, first_index: int = 0) -> ResponseItems:
    return ResponseItems(state, plan.tool_names, "reasoning.encrypted_content" in (plan.req.include or []),
                         first_index)


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


def _remember(plan: ResponsePlan, state: ChoiceState, store: ResponseStore, response_id: str | None = None) -> None:
    """``response_id``: the response's, where it is not the plan's own (an automatic compaction's reply)."""
    if plan.compaction is None:  # a summary turn continues nothing: its items are the conversation's state
        store.remember(plan.chat.generation.request.cache_salt, response_id or plan.chat.request_id,
                       [*plan.history, state.message()], stored=bool(plan.req.store))


async def complete_response(
    ctx: ServingContext, plan: ResponsePlan, stream: RequestStream, store: ResponseStore
) -> dict[str, Any]:
    state = await finished_state(ctx, plan.chat, stream)
    if plan.compaction is not None and plan.compaction.then is not None:
        item = plan.compaction.item(state)
        reply, reply_stream = await _reply_after(ctx, plan, stream, item)
        reply_state = await finished_state(ctx, reply.chat, reply_stream)
        _remember(reply, reply_state, store, plan.chat.request_id)
        output = [item, *_items(reply, reply_state, 1).output()]
        return {**_response(ctx, reply, output, reply_state, _both((plan, state), (reply, reply_state))),
                "id": plan.chat.request_id}
    _remember(plan, state, store)
    output = plan.compaction.items(state) if plan.compaction else _items(plan, state).output()
    return _response(ctx, plan, output, state)


async def _reply_after(ctx: ServingContext, plan: ResponsePlan, stream: RequestStream,
                       item: dict) -> tuple[ResponsePlan, RequestStream]:
    """An automatic compaction's reply, generated once its summary turn (``stream``) has ended."""
    then = plan.compaction.then if plan.compaction else None
    assert then is not None
    return await continue_after(ctx, stream, lambda: then(item), lambda p: p.chat.generation)


async def compact_response(ctx: ServingContext, plan: ResponsePlan, stream: RequestStream) -> dict[str, Any]:
    """`POST /v1/responses/compact`: the conversation's user messages and one `compaction` item."""
    assert plan.compaction is not None
    state = await finished_state(ctx, plan.chat, stream)
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
    response_id, usage = plan.chat.request_id, None
    if plan.compaction is not None:  # the summary is sealed whole: its item is added and done at the end
        state = await finished_state(ctx, plan.chat, stream)
        output = plan.compaction.items(state)
        for index, item in enumerate(output):
            yield numbered({"type": "response.output_item.added", "output_index": index, "item": item})
            yield numbered({"type": "response.output_item.done", "output_index": index, "item": item})
        if plan.compaction.then is not None:  # then the reply, after the item
            summary = (plan, state)
            plan, reply_stream = await _reply_after(ctx, plan, stream, output[0])
            [state] = states = choice_states(ctx, plan.chat, streaming=True)
            items = _items(plan, state, first_index=1)
            async for event in _run(ctx, plan, reply_stream, items, states):
                yield numbered(event)
            output = [*output, *items.output()]
            usage = _both(summary, (plan, state))
    else:
        async for event in _run(ctx, plan, stream, items, states):
            yield numbered(event)
        output = items.output()
    _remember(plan, state, store, response_id)
    final = {**_response(ctx, plan, output, state, usage), "id": response_id}  # the reply's, under the response's id
    yield numbered({"type": f"response.{final['status']}", "response": final})


async def prefill_events(ctx: ServingContext, plan: ResponsePlan, stream: RequestStream,
                         store: ResponseStore) -> AsyncIterator[Event]:
    """A warm-up's events (`generate: false` over a WebSocket): its prompt prefilled into the cache (the plan asks
    for one token, which is dropped), then `response.created` and `response.completed` with no output. A later
    request can continue it (`previous_response_id`: its conversation, nothing added)."""
    state = await finished_state(ctx, plan.chat, stream)
    store.remember(plan.chat.generation.request.cache_salt, plan.chat.request_id, plan.history,
                   stored=bool(plan.req.store))
    final = {**_response(ctx, plan, [], state), "status": "completed"}
    final["usage"] = Usage.of([plan.chat.generation], 0).responses()
    yield {"type": "response.created", "response": _response(ctx, plan, [], None), "sequence_number": 0}
    yield {"type": "response.completed", "response": final, "sequence_number": 1}
