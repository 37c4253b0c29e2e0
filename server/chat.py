"""`POST /v1/chat/completions`: request -> prompt token ids (renderer) and the grammar that guarantees `tool_choice`
and `response_format`; engine output -> assistant message (reasoning and tool-call parsers), as one JSON response or
as SSE chunks.

The engine detokenizes with special tokens kept, so tool-call and thinking markers reach the parsers; the parsers
are split-independent, so the streamed deltas concatenate to the non-streamed message (except for a call the output
cuts off: streamed, its arguments are closed into valid JSON; not streamed, it stays content).
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from server.async_engine import EngineRequest, RequestStream
from server.context import ServingContext, new_request_id
from server.generation import SSE_DONE, Choice, Prompt, outputs, record, sse, usage
from server.logprobs import chat_logprobs
from server.parsing import OutputParser, default_thinking, get_output_parser, new_id_prefix
from server.parsing.constraint import ConstraintError, output_constraint
from server.protocol import APIError, ChatCompletionRequest


@dataclass
class ChatPlan:
    """A validated chat request, rendered and tokenized, ready for the engine."""

    request_id: str
    created: int
    req: ChatCompletionRequest
    body: dict[str, Any]
    prompt: Prompt
    thinking: bool  # this request's output starts with / may contain reasoning
    num_top_logprobs: int | None  # None: no logprobs


def request_thinking(family: str, template_kwargs: dict[str, Any]) -> bool:
    """Whether thinking is on, read the way the templates read it: Qwen3 turns it off only with an explicit
    `enable_thinking: false`, DeepSeek-V3.1 turns it on with a truthy `thinking`."""
    if "enable_thinking" in template_kwargs:
        return template_kwargs["enable_thinking"] is not False
    if "thinking" in template_kwargs:
        return bool(template_kwargs["thinking"])
    return default_thinking(family)


def plan_chat(
    ctx: ServingContext, req: ChatCompletionRequest, body: dict[str, Any], cache_salt: str | None, created: int
) -> ChatPlan:
    ctx.check_model(req.model)
    kwargs = req.chat_template_kwargs or {}
    try:
        text = ctx.renderer.render(req.messages, req.tools, req.add_generation_prompt, **kwargs)
    except ValueError as exc:
        raise APIError(400, str(exc), param="tools" if str(exc).startswith("tools") else "messages") from None
    thinking = request_thinking(ctx.family, kwargs)
    try:
        constraint = output_constraint(
            ctx.family, req.tools, req.tool_choice, req.parallel_tool_calls, req.response_format, reasoning=thinking,
            structured_outputs=req.structured_outputs,
        )
    except ConstraintError as exc:
        raise APIError(400, str(exc), param=exc.param) from None
    prompt_ids = ctx.encode(text)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    num_top = (req.top_logprobs or 0) if req.logprobs else None
    params = ctx.sampling_params(
        req, len(prompt_ids), skip_special_tokens=False, num_logprobs=num_top, structured_output=constraint
    )
    request_id = new_request_id("chatcmpl")
    return ChatPlan(
        request_id, created, req, body, Prompt(EngineRequest(request_id, prompt_ids, params, cache_salt)), thinking,
        num_top,
    )


@dataclass
class _ChoiceState:
    parser: OutputParser
    choice: Choice = field(default_factory=Choice)
    unsent_logprobs: list = field(default_factory=list)  # logprobs of tokens whose text the parser still holds


def _choice_states(ctx: ServingContext, plan: ChatPlan, streaming: bool) -> list[_ChoiceState]:
    # tool_choice was validated when the request was planned; one id prefix per choice keeps call ids unique.
    return [
        _ChoiceState(get_output_parser(
            ctx.family, plan.req.tools, plan.req.tool_choice, reasoning=plan.thinking, id_prefix=new_id_prefix(),
            streaming=streaming,
        ))
        for _ in range(plan.req.n)
    ]


def _finish_reason(engine_reason: str | None, parser: OutputParser) -> str | None:
    if engine_reason == "stop" and parser.result().finish_reason_override:
        return parser.result().finish_reason_override
    return engine_reason


async def complete_chat(ctx: ServingContext, plan: ChatPlan, stream: RequestStream) -> dict[str, Any]:
    states = _choice_states(ctx, plan, streaming=False)
    try:
        async for _, out in outputs(stream, [plan.prompt]):
            states[out.index].choice.add(out)
    finally:
        record(ctx, "chat", plan.body, [plan.prompt])
    choices = []
    for index, state in enumerate(states):
        state.parser.feed(state.choice.text)
        state.parser.finish()
        parsed = state.parser.result()
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if parsed.reasoning_content is not None:
            message["reasoning_content"] = parsed.reasoning_content
        if parsed.tool_calls:
            message["tool_calls"] = parsed.tool_calls
        logprobs = None
        if plan.num_top_logprobs is not None:
            logprobs = chat_logprobs(ctx.token_texts, state.choice.logprobs, plan.num_top_logprobs)
        choices.append({
            "index": index,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": _finish_reason(state.choice.finish_reason, state.parser),
        })
    return {
        "id": plan.request_id,
        "object": "chat.completion",
        "created": plan.created,
        "model": ctx.model_name,
        "choices": choices,
        "usage": usage([plan.prompt], sum(len(s.choice.token_ids) for s in states)),
    }


async def stream_chat(ctx: ServingContext, plan: ChatPlan, stream: RequestStream) -> AsyncIterator[str]:
    """SSE: a role delta per choice, content / reasoning / tool-call deltas, a finish chunk per choice, then (with
    `stream_options.include_usage`) a usage chunk with no choices, then `[DONE]`."""
    include_usage = plan.req.include_usage

    def chunk(choices: list[dict[str, Any]], usage_value: dict[str, Any] | None = None) -> str:
        payload: dict[str, Any] = {
            "id": plan.request_id, "object": "chat.completion.chunk", "created": plan.created,
            "model": ctx.model_name, "choices": choices,
        }
        if include_usage:
            payload["usage"] = usage_value
        return sse(payload)

    def choice_chunk(index: int, delta: dict[str, Any], state: _ChoiceState, finish_reason: str | None = None):
        logprobs = None
        if plan.num_top_logprobs is not None and state.unsent_logprobs:
            logprobs = chat_logprobs(ctx.token_texts, state.unsent_logprobs, plan.num_top_logprobs)
            state.unsent_logprobs = []
        return chunk([{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}])

    states = _choice_states(ctx, plan, streaming=True)
    try:
        for index, state in enumerate(states):
            yield choice_chunk(index, {"role": "assistant", "content": ""}, state)
        async for _, out in outputs(stream, [plan.prompt]):
            state = states[out.index]
            state.choice.add(out)
            state.unsent_logprobs += out.new_logprobs
            deltas = state.parser.feed(out.new_text) if out.new_text else []
            if out.finished:
                deltas += state.parser.finish()
            for delta in deltas:
                yield choice_chunk(out.index, delta, state)
            if out.finished:
                reason = _finish_reason(state.choice.finish_reason, state.parser)
                yield choice_chunk(out.index, {}, state, reason)
    finally:
        record(ctx, "chat", plan.body, [plan.prompt])
    if include_usage:
        yield chunk([], usage([plan.prompt], sum(len(s.choice.token_ids) for s in states)))
    yield SSE_DONE
