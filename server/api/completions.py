"""`POST /v1/completions`: raw text completion of a prompt given as text or token ids (or a batch of them; each is its
own engine request, and its n choices are numbered `prompt_index * n + i`). No chat template, no parsing; a
`response_format` JSON schema is enforced by the grammar.

Scoring (what lm-eval's `local-completions` sends for loglikelihood tasks): `echo` with `logprobs` returns the
prompt's tokens and logprobs before the completion's, and vLLM's `prompt_logprobs` adds each prompt token's logprob
in vLLM's shape; both are computed in the prefill (engine/worker/prompt_logprobs.py). `max_tokens: 0` scores without
generating."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from server.pipeline.async_engine import EngineRequest, RequestStream
from server.pipeline.context import ServingContext, new_request_id
from server.pipeline.generation import Generation, Usage, outputs, record
from server.http.limits import check_request, check_sampling, check_scored
from server.pipeline.logprobs import completion_logprobs, echoed_logprobs, vllm_prompt_logprobs
from server.parsing.constraint import ConstraintError, completion_constraint
from server.api.protocol import APIError, CompletionRequest
from server.http.sse import SSE_DONE, sse
from server.pipeline.turn import Sampling


@dataclass
class CompletionPlan:
    request_id: str
    created: int
    req: CompletionRequest
    body: dict[str, Any]
    prompts: list[Generation]
    echo_texts: list[str]  # per prompt: the text echoed before the completion ('' without echo)


def _prompt_ids(ctx: ServingContext, prompt: str | list[int] | list[str] | list[list[int]]) -> list[list[int]]:
    if isinstance(prompt, str):
        return [ctx.encode_prompt(prompt, "prompt")]
    if prompt and isinstance(prompt[0], str):
        return [ctx.encode_prompt(p, "prompt") for p in prompt]
    if prompt and isinstance(prompt[0], list):
        return [list(p) for p in prompt]
    return [list(prompt)]


def _num_prompts(prompt: str | list[int] | list[str] | list[list[int]]) -> int:
    """How many prompts a `prompt` field holds (a batch of texts or of token lists), before any is tokenized."""
    return len(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else 1


def plan_completion(
    ctx: ServingContext, req: CompletionRequest, body: dict[str, Any], cache_salt: str | None, created: int
) -> CompletionPlan:
    ctx.check_model(req.model)
    check_request(ctx.settings.limits, response_format=req.response_format, structured_outputs=req.structured_outputs)
    try:
        constraint = completion_constraint(req.response_format, req.structured_outputs)
    except ConstraintError as exc:
        raise APIError(400, str(exc), param=exc.param) from None
    param = "structured_outputs" if req.structured_outputs is not None else "response_format"
    sampling = Sampling.of(req, req.max_tokens)
    check_sampling(ctx.settings.limits, sampling, _num_prompts(req.prompt))
    token_lists = _prompt_ids(ctx, req.prompt)
    check_scored(ctx.settings.limits, map(len, token_lists), req.n, echo=req.echo, echo_logprobs=req.logprobs,
                 prompt_logprobs=req.prompt_logprobs)
    vocab = ctx.engine.facts.vocab_size
    bad = next((t for ids in token_lists for t in ids if not 0 <= t < vocab), None)
    if bad is not None:  # before anything decodes them (echo)
        raise APIError(400, f"token id {bad} is outside the vocabulary [0, {vocab})", param="prompt")
    request_id = new_request_id("cmpl")
    prompts = []
    for i, ids in enumerate(token_lists):
        params = ctx.sampling_params(
            sampling, len(ids), skip_special_tokens=True, num_logprobs=req.logprobs, structured_output=constraint,
            prompt_logprobs=_prompt_logprobs(req),
        )
        engine_id = request_id if len(token_lists) == 1 else f"{request_id}-{i}"
        prompts.append(Generation(EngineRequest(engine_id, ids, params, cache_salt), constraint_param=param))
    echo = [ctx.tokenizer.decode(ids) if req.echo else "" for ids in token_lists]
    return CompletionPlan(request_id, created, req, body, prompts, echo)


def _prompt_logprobs(req: CompletionRequest) -> int | None:
    """How many alternatives each prompt token needs: `echo` with `logprobs` shows them, so does `prompt_logprobs`."""
    asked = [n for n in (req.prompt_logprobs, req.logprobs if req.echo else None) if n is not None]
    return max(asked) if asked else None


def _logprobs(ctx: ServingContext, plan: CompletionPlan, prompt: Generation, entries: list,
              offset: int, echoed: bool) -> dict[str, list] | None:
    """The choice's `logprobs` (`entries`: its tokens' from `offset` on); `echoed`: the prompt's tokens lead."""
    if plan.req.logprobs is None:
        return None
    if not echoed:
        return completion_logprobs(ctx.token_texts, entries, plan.req.logprobs, offset)
    return echoed_logprobs(ctx.token_texts, prompt.request.prompt_token_ids, prompt.first_choice.prompt_logprobs,
                           entries, plan.req.logprobs, offset)


def _echo_fields(ctx: ServingContext, plan: CompletionPlan, prompt: Generation) -> dict[str, Any]:
    """vLLM's `prompt_logprobs` field of a choice, when asked."""
    if plan.req.prompt_logprobs is None:
        return {}
    scored = prompt.first_choice.prompt_logprobs
    return {"prompt_logprobs": vllm_prompt_logprobs(ctx.token_texts, scored, plan.req.prompt_logprobs)}


def _usage(plan: CompletionPlan) -> Usage:
    return Usage.of(plan.prompts, sum(len(c.token_ids) for p in plan.prompts for c in p.choices))


def _response(ctx: ServingContext, plan: CompletionPlan, choices: list[dict[str, Any]], **extra: Any) -> dict:
    return {
        "id": plan.request_id, "object": "text_completion", "created": plan.created, "model": ctx.model_name,
        "choices": choices, **extra,
    }


async def complete_text(ctx: ServingContext, plan: CompletionPlan, stream: RequestStream) -> dict[str, Any]:
    n = plan.req.n
    try:
        async for _ in outputs(stream, plan.prompts):
            pass
    finally:
        record(ctx, "completions", plan.body, plan.prompts)
    # Off the event loop: a long prompt's echoed or scored logprobs name tens of thousands of tokens (seconds of
    # Python that would stall every other stream)
    body = await asyncio.to_thread(lambda: [
        {
            "index": index,
            "text": plan.echo_texts[index // n] + choice.text,
            "logprobs": _logprobs(ctx, plan, plan.prompts[index // n], choice.logprobs,
                                  len(plan.echo_texts[index // n]), plan.req.echo),
            "finish_reason": choice.finish_reason,
            **_echo_fields(ctx, plan, plan.prompts[index // n]),
        }
        for index, choice in enumerate(c for p in plan.prompts for c in p.choices)
    ])
    return _response(ctx, plan, body, usage=_usage(plan).openai())


async def stream_text(ctx: ServingContext, plan: CompletionPlan, stream: RequestStream) -> AsyncIterator[str]:
    n, include_usage = plan.req.n, plan.req.include_usage
    offsets = [len(plan.echo_texts[i // n]) for i in range(len(plan.prompts) * n)]  # text_offset of the next token

    def chunk(choices_json: list[dict[str, Any]], usage_value: dict[str, Any] | None = None) -> str:
        return sse(_response(ctx, plan, choices_json, **({"usage": usage_value} if include_usage else {})))

    echoed = [False] * len(offsets)  # the prompt's chunk is sent with the choice's first output (its logprobs)
    try:
        async for i, out in outputs(stream, plan.prompts):
            index = i * n + out.index
            if plan.req.echo and not echoed[index]:
                echoed[index] = True
                prompt = plan.prompts[i]
                logprobs, fields = await asyncio.to_thread(  # (off the event loop, as in complete_text)
                    lambda: (_logprobs(ctx, plan, prompt, [], 0, echoed=True), _echo_fields(ctx, plan, prompt)))
                yield chunk([{"index": index, "text": plan.echo_texts[i], "logprobs": logprobs, "finish_reason": None,
                              **fields}])
            elif plan.req.prompt_logprobs is not None and out.prompt_logprobs is not None:
                fields = await asyncio.to_thread(_echo_fields, ctx, plan, plan.prompts[i])
                yield chunk([{"index": index, "text": "", "logprobs": None, "finish_reason": None, **fields}])
            if not out.new_text and not out.finished and plan.req.logprobs is None:
                continue  # a token whose text is held back (partial character, possible stop string)
            logprobs = _logprobs(ctx, plan, plan.prompts[i], out.new_logprobs, offsets[index], echoed=False)
            if logprobs is not None:
                offsets[index] += sum(len(t) for t in logprobs["tokens"])
            yield chunk([{"index": index, "text": out.new_text, "logprobs": logprobs,
                          "finish_reason": out.finish_reason}])
    finally:
        record(ctx, "completions", plan.body, plan.prompts)
    if include_usage:
        yield chunk([], _usage(plan).openai())
    yield SSE_DONE
