"""`POST /v1/chat/completions`: a chat request as a turn (`chat_turn`; `server.pipeline.plan.plan_turn` renders,
constrains and tokenizes it, as it does the other APIs' turns), and the engine's output as an assistant message
(reasoning and tool-call parsers), in one JSON response or as SSE chunks.

The engine detokenizes with special tokens kept, so tool-call and thinking markers reach the parsers; the parsers
are split-independent, so the streamed deltas concatenate to the non-streamed message (except for a call the output
cuts off: streamed, its arguments are closed into valid JSON; not streamed, it is dropped).
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from server.api.protocol import APIError, ChatCompletionRequest, TokenizeRequest
from server.http.sse import SSE_DONE, sse
from server.parsing import Delta
from server.parsing.deltas import tool_call_dict
from server.pipeline.async_engine import RequestStream
from server.pipeline.choices import ChoiceState, choice_states, parsed_updates
from server.pipeline.context import ServingContext
from server.pipeline.generation import Usage
from server.pipeline.logprobs import chat_logprobs, vllm_prompt_logprobs
from server.pipeline.plan import Plan, chat_template_kwargs, record_plan
from server.pipeline.turn import Sampling, Turn


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
        sampling=replace(Sampling.of(req, req.requested_max_tokens), reasoning_effort=req.reasoning_effort),
        num_top_logprobs=(req.top_logprobs or 0) if req.logprobs else None, prompt_logprobs=req.prompt_logprobs,
        include_usage=req.include_usage, session=session,
    )


def tokenize_turn(req: TokenizeRequest, family: str) -> Turn:
    """/tokenize's messages, rendered as a chat request with the same fields would be."""
    assert req.messages is not None
    return Turn(messages=req.messages, model=req.model, tools=req.tools,
                template_kwargs=chat_template_kwargs(family, req.chat_template_kwargs),
                add_generation_prompt=req.add_generation_prompt)


async def complete_chat(ctx: ServingContext, plan: Plan, stream: RequestStream) -> dict[str, Any]:
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
        "usage": Usage.of([plan.generation], sum(s.num_tokens for s in states), plan.reasoning_tokens()).openai(),
    }
    if plan.turn.prompt_logprobs is not None:  # vLLM's extension, in vLLM's shape
        scored = plan.generation.first_choice.prompt_logprobs
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


async def stream_chat(ctx: ServingContext, plan: Plan, stream: RequestStream) -> AsyncIterator[str]:
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
        yield chunk([], Usage.of([plan.generation], sum(s.num_tokens for s in states), plan.reasoning_tokens()).openai())
    yield SSE_DONE
