"""`POST /v1/chat/completions`: request -> prompt token ids (renderer) and the grammar that guarantees `tool_choice`
and `response_format`; engine output -> assistant message (reasoning and tool-call parsers), as one JSON response or
as SSE chunks.

`plan_chat` plans a `server.pipeline.turn.Turn`, whichever API it came from: a chat request becomes one here (`chat_turn`),
`/v1/messages` and `/v1/responses` make theirs in their adapters and format `server.pipeline.choices.parsed_updates` their
own way.
The engine detokenizes with special tokens kept, so tool-call and thinking markers reach the parsers; the parsers
are split-independent, so the streamed deltas concatenate to the non-streamed message (except for a call the output
cuts off: streamed, its arguments are closed into valid JSON; not streamed, it is dropped).
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from server.pipeline.async_engine import EngineRequest, RequestStream
from server.cache.cache_control import breakpoint_pins, chat_breakpoints, snapshot_hints
from server.pipeline.context import ServingContext, new_request_id
from server.pipeline.generation import Prompt, Usage, record
from server.http.limits import check_request, check_sampling, check_scored
from server.pipeline.logprobs import chat_logprobs, vllm_prompt_logprobs
from server.cache.normalize import normalize_for_cache
from server.parsing import Delta, default_thinking
from server.parsing.constraint import ConstraintError, output_constraint
from server.parsing.deltas import tool_call_dict
from server.pipeline.choices import ChoiceState, choice_states, parsed_updates
from server.api.protocol import APIError, ChatCompletionRequest, TokenizeRequest
from server.rendering import serving_template_kwargs
from server.http.sse import SSE_DONE, sse
from server.pipeline.turn import Sampling, Turn

# The template kwarg that switches thinking, per family with a switch.
_THINKING_SWITCH = {
    "qwen3": "enable_thinking", "qwen3.6": "enable_thinking",
    "deepseek-v3.1": "thinking", "deepseek-v3.2": "thinking", "deepseek-v4": "thinking",
}
# Families whose template takes a `reasoning_effort` kwarg of its own.
_EFFORT_KWARG_FAMILIES = ("deepseek-v4",)
OFF_EFFORTS = ("none", "minimal")


@dataclass
class ChatPlan:
    """A turn, rendered and tokenized, ready for the engine."""

    request_id: str
    created: int
    turn: Turn  # as the engine runs it: a named cache's messages first
    body: dict[str, Any]
    prompt: Prompt
    thinking: bool  # this request's output starts with / may contain reasoning
    endpoint: str = "chat"  # which API it came from, for the record
    pinned_tokens: int = 0  # prompt tokens up to the last cache_control breakpoint


def request_thinking(family: str, template_kwargs: dict[str, Any]) -> bool:
    """Whether thinking is on, read the way the templates read it: Qwen3 turns it off only with an explicit
    `enable_thinking: false`, DeepSeek-V3.1 turns it on with a truthy `thinking`."""
    if "enable_thinking" in template_kwargs:
        return template_kwargs["enable_thinking"] is not False
    if "thinking" in template_kwargs:
        return bool(template_kwargs["thinking"])
    return default_thinking(family)


def thinking_kwargs(family: str, thinking: bool | None) -> dict[str, Any]:
    """The template kwargs that turn thinking on or off (None: the family's default); {} without a switch."""
    key = _THINKING_SWITCH.get(family)
    return {key: thinking} if key and thinking is not None else {}


def effort_kwargs(family: str, effort: str | None) -> dict[str, Any]:
    """A reasoning effort (OpenAI's `reasoning_effort` / Responses' `reasoning.effort`, Anthropic's
    `output_config.effort`) as template kwargs: `none` and `minimal` turn thinking off, any other on; DeepSeek-V4 also
    takes the effort itself, `max` (from `max` or `xhigh`, which adds V4's maximum-effort prefix) or `high`."""
    if effort is None:
        return {}
    on = effort not in OFF_EFFORTS
    kwargs = thinking_kwargs(family, on)
    if on and family in _EFFORT_KWARG_FAMILIES:
        kwargs["reasoning_effort"] = "max" if effort in ("max", "xhigh") else "high"
    return kwargs


# The renderer's own arguments: a template kwarg cannot take their place.
_RESERVED_TEMPLATE_KWARGS = frozenset({"self", "messages", "tools", "add_generation_prompt"})


def chat_template_kwargs(family: str, requested: dict[str, Any] | None, effort: str | None = None) -> dict[str, Any]:
    """A request's template kwargs: its `chat_template_kwargs` over what its `reasoning_effort` asks for."""
    kwargs = requested or {}
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if reserved:
        raise APIError(400, f"chat_template_kwargs may not set {', '.join(reserved)}: send them as request fields",
                       param="chat_template_kwargs")
    return {**effort_kwargs(family, effort), **kwargs}


def chat_turn(req: ChatCompletionRequest, family: str, session: str | None = None) -> Turn:
    """A chat completions request as a turn (the chat API's adapter)."""
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    if req.prompt_logprobs is not None and req.stream:
        raise APIError(400, "prompt_logprobs is returned with the whole response only; send stream: false",
                       param="prompt_logprobs")
    return Turn(
        messages=req.messages, model=req.model, tools=req.tools, tool_choice=req.tool_choice,
        parallel_tool_calls=req.parallel_tool_calls, response_format=req.response_format,
        structured_outputs=req.structured_outputs, template_kwargs=chat_template_kwargs(family, req.chat_template_kwargs, req.reasoning_effort),
        add_generation_prompt=req.add_generation_prompt, cached_content=req.cached_content,
        sampling=Sampling.of(req, req.requested_max_tokens),
        num_top_logprobs=(req.top_logprobs or 0) if req.logprobs else None, prompt_logprobs=req.prompt_logprobs,
        include_usage=req.include_usage, session=session,
    )


def tokenize_turn(req: TokenizeRequest, family: str) -> Turn:
    """/tokenize's messages, rendered as a chat request with the same fields would be."""
    assert req.messages is not None
    return Turn(messages=req.messages, model=req.model, tools=req.tools,
                template_kwargs=chat_template_kwargs(family, req.chat_template_kwargs),
                add_generation_prompt=req.add_generation_prompt)


def render_chat(ctx: ServingContext, turn: Turn) -> str:
    """The prompt text of a turn, after the cache-stability rules (server/cache/normalize.py)."""
    check_request(ctx.settings.limits, messages=turn.messages, tools=turn.tools)
    try:
        return _render(ctx, turn.messages, turn.tools, turn.add_generation_prompt, turn.template_kwargs)
    except ValueError as exc:
        raise APIError(400, str(exc), param="tools" if str(exc).startswith("tools") else "messages") from None


def guards_only_auto_calls(turn: Turn) -> bool:
    """The turn's grammar (if any) only keeps the tool calls the model chooses to open valid: nothing else is
    promised, so the request can run without it."""
    choice = turn.tool_choice
    return (choice is None or choice == "auto") and not turn.structured_answer


def _render(ctx: ServingContext, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool,
            kwargs: dict[str, Any]) -> str:
    kwargs = {**serving_template_kwargs(ctx.renderer, ctx.settings.preserve_thinking), **kwargs}
    return ctx.renderer.render(normalize_for_cache(messages, ctx.renderer), tools, add_generation_prompt, **kwargs)


def with_cached_content(ctx: ServingContext, turn: Turn, cache_salt: str | None) -> Turn:
    """A turn naming a cache (`cached_content`) continues the cache's messages (server/cache/named_caches.py)."""
    if turn.cached_content is None:
        return turn
    return ctx.named_caches.use(cache_salt, turn.cached_content).continue_with(turn)


def chat_prompt_text(ctx: ServingContext, turn: Turn, cache_salt: str | None) -> tuple[Turn, str]:
    """The turn as the engine runs it (a named cache's messages first, its breakpoints with them; by default
    those on chat content parts), and its prompt text."""
    ctx.check_model(turn.model)
    if turn.breakpoints is None:
        turn = replace(turn, breakpoints=chat_breakpoints(turn.messages, turn.tools))
    turn = with_cached_content(ctx, turn, cache_salt)
    return turn, render_chat(ctx, turn)


def plan_chat(ctx: ServingContext, turn: Turn, body: dict[str, Any], cache_salt: str | None, created: int,
              *, endpoint: str = "chat", id_prefix: str = "chatcmpl") -> ChatPlan:
    """A turn (from any API) rendered, constrained, tokenized and made an engine request."""
    # Messages and tools are checked where they are rendered (`render_chat`).
    check_request(ctx.settings.limits, response_format=turn.response_format,
                  structured_outputs=turn.structured_outputs)
    check_sampling(ctx.settings.limits, turn.sampling)
    turn, text = chat_prompt_text(ctx, turn, cache_salt)
    thinking = request_thinking(ctx.family, turn.template_kwargs)
    try:
        constraint = output_constraint(
            ctx.family, turn.tools, turn.tool_choice, turn.parallel_tool_calls, turn.response_format,
            reasoning=thinking, structured_outputs=turn.structured_outputs,
        )
    except ConstraintError as exc:
        raise APIError(400, str(exc), param=exc.param) from None
    prompt_ids = ctx.encode_prompt(text, "messages")
    check_scored(ctx.settings.limits, [len(prompt_ids)], turn.sampling.n, prompt_logprobs=turn.prompt_logprobs)
    params = ctx.sampling_params(
        turn.sampling, len(prompt_ids), skip_special_tokens=False, num_logprobs=turn.num_top_logprobs,
        structured_output=constraint, prompt_logprobs=turn.prompt_logprobs, session=turn.session,
    )
    cut = lambda m, t: _render(ctx, m, t, False, turn.template_kwargs)  # noqa: E731 - a conversation cut, rendered
    pins = breakpoint_pins(turn.breakpoints or [], text, prompt_ids, cut, ctx.encode)
    hints = (snapshot_hints(turn.messages, turn.tools, text, prompt_ids, cut, ctx.encode)
             if ctx.recurrent_state else ())
    request_id = new_request_id(id_prefix)
    request = EngineRequest(request_id, prompt_ids, params, cache_salt, ctx.retention(pins, turn.session, cache_salt, hints))
    prompt = Prompt(request, constraint_param="tools", constraint_optional=guards_only_auto_calls(turn))
    return ChatPlan(request_id, created, turn, body, prompt, thinking, endpoint,
                    max((p.num_tokens for p in pins), default=0))


def record_plan(ctx: ServingContext, plan: ChatPlan) -> None:
    record(ctx, plan.endpoint, plan.body, [plan.prompt], session=plan.turn.session, turn=plan.turn)


async def complete_chat(ctx: ServingContext, plan: ChatPlan, stream: RequestStream) -> dict[str, Any]:
    states = choice_states(ctx, plan, streaming=False)
    try:
        async for _ in parsed_updates(ctx, plan, stream, states):
            pass
    finally:
        record_plan(ctx, plan)
    choices = []
    for index, state in enumerate(states):
        logprobs = None
        if plan.turn.num_top_logprobs is not None:
            logprobs = chat_logprobs(ctx.token_texts, state.output.logprobs, plan.turn.num_top_logprobs)
        choices.append({
            "index": index, "message": state.message(), "logprobs": logprobs, "finish_reason": state.finish_reason(),
        })
    response = {
        "id": plan.request_id,
        "object": "chat.completion",
        "created": plan.created,
        "model": ctx.model_name,
        "system_fingerprint": ctx.instance_id,
        "choices": choices,
        "usage": Usage.of([plan.prompt], sum(s.num_tokens for s in states)).openai(),
    }
    if plan.turn.prompt_logprobs is not None:  # vLLM's extension, in vLLM's shape
        scored = plan.prompt.first_choice.prompt_logprobs
        response["prompt_logprobs"] = vllm_prompt_logprobs(ctx.token_texts, scored, plan.turn.prompt_logprobs)
    return response


def openai_delta(delta: Delta) -> dict[str, Any]:
    """A parsed delta as a chat-completion chunk's `delta`."""
    if delta.kind == "text":
        return {"content": delta.text}
    if delta.kind == "reasoning":
        return {"reasoning_content": delta.text}
    if delta.kind == "call":
        return {"tool_calls": [{"index": delta.call_index, **tool_call_dict(delta.call_id, delta.text)}]}
    return {"tool_calls": [{"index": delta.call_index, "function": {"arguments": delta.text}}]}


async def stream_chat(ctx: ServingContext, plan: ChatPlan, stream: RequestStream) -> AsyncIterator[str]:
    """SSE: a role delta per choice, content / reasoning / tool-call deltas, a finish chunk per choice, then (with
    `stream_options.include_usage`) a usage chunk with no choices, then `[DONE]`."""
    include_usage = plan.turn.include_usage

    def chunk(choices: list[dict[str, Any]], usage_value: dict[str, Any] | None = None) -> str:
        payload: dict[str, Any] = {
            "id": plan.request_id, "object": "chat.completion.chunk", "created": plan.created,
            "model": ctx.model_name, "system_fingerprint": ctx.instance_id, "choices": choices,
        }
        if include_usage:
            payload["usage"] = usage_value
        return sse(payload)

    def choice_chunk(index: int, delta: dict[str, Any], state: ChoiceState, finish_reason: str | None = None):
        logprobs = None
        if plan.turn.num_top_logprobs is not None and state.unsent_logprobs:
            logprobs = chat_logprobs(ctx.token_texts, state.unsent_logprobs, plan.turn.num_top_logprobs)
            state.unsent_logprobs = []
        return chunk([{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}])

    states = choice_states(ctx, plan, streaming=True)
    try:
        for index, state in enumerate(states):
            yield choice_chunk(index, {"role": "assistant", "content": ""}, state)
        async for update in parsed_updates(ctx, plan, stream, states):
            for delta in update.deltas:
                yield choice_chunk(update.index, openai_delta(delta), update.state)
            if update.finish_reason is not None:
                yield choice_chunk(update.index, {}, update.state, update.finish_reason)
    finally:
        record_plan(ctx, plan)
    if include_usage:
        yield chunk([], Usage.of([plan.prompt], sum(s.num_tokens for s in states)).openai())
    yield SSE_DONE
