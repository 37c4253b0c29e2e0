"""What chat and text completions share: submitting engine requests, accumulating each choice's output, usage,
SSE framing and recording."""
from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from engine.errors import RequestRejected
from engine.text.output_processor import CompletionOutput
from engine.outputs import DraftStats, FinishReason, RequestTimings, SequenceOutput
from engine.worker.grammar_compile import CompileCancelled
from server.pipeline.async_engine import EngineDeadError, EngineRequest, RequestStream
from server.pipeline.context import ServingContext
from server.api.protocol import APIError
from server.pipeline.recorder import RequestRecord, timing_fields
from server.pipeline.turn import Turn

log = logging.getLogger("kvserve.server")


@dataclass
class Generation:
    """One engine request of an HTTP request, and what came back for it: the one accumulation of its outputs."""

    request: EngineRequest
    constraint_param: str = "response_format"  # the field a grammar that cannot be compiled came from (its 400)
    constraint_optional: bool = False  # the grammar only guards optional tool calls: without it the request runs
    num_cached_tokens: int = 0
    timings: RequestTimings | None = None
    num_host_cached_tokens: int = 0  # of num_cached_tokens, restored from the host tier
    num_disk_cached_tokens: int = 0  # ... and from the disk tier
    num_pinned_tokens: int = 0  # leading prompt tokens its breakpoints really retain (the engine's word)
    speculation: DraftStats | None = None  # choice 0's speculative decoding counters, for the record
    choices: list[CompletionOutput] = field(init=False)  # per sequence (n > 1): its tokens, text and logprobs so far
    _ended: set[int] = field(default_factory=set, init=False)  # choices whose output ended before the engine's

    def __post_init__(self) -> None:
        self.choices = [CompletionOutput(index=i) for i in range(self.request.params.n)]

    @property
    def first_choice(self) -> CompletionOutput:
        return self.choices[0]

    def end_choice(self, index: int) -> None:
        """The choice's output is complete (a parser stopped it at a call limit): what the engine still sends for
        it is dropped."""
        self._ended.add(index)

    def observe(self, out: SequenceOutput) -> bool:
        """Take one output; False when its choice had ended."""
        if out.index in self._ended:
            return False
        if out.index == 0:
            self.num_cached_tokens = out.num_cached_tokens  # siblings (n > 1) share the leader's cached prompt
            self.num_host_cached_tokens = out.num_host_cached_tokens
            self.num_disk_cached_tokens = out.num_disk_cached_tokens
            self.num_pinned_tokens = out.num_pinned_tokens
            self.timings = out.timings
            if out.speculation is not None:
                self.speculation = out.speculation
        self.choices[out.index].add(out)
        return True


@dataclass(frozen=True)
class Usage:
    """A response's token counts, API-neutral; each API formats them its own way."""

    prompt_tokens: int
    cached_tokens: int  # of the prompt, served by the prefix cache
    completion_tokens: int
    reasoning_tokens: int = 0  # of the completion, thinking (server/pipeline/reasoning_budget.py)

    @classmethod
    def of(cls, prompts: list[Generation], completion_tokens: int, reasoning_tokens: int = 0) -> Usage:
        return cls(sum(len(p.request.prompt_token_ids) for p in prompts), sum(p.num_cached_tokens for p in prompts),
                   completion_tokens, reasoning_tokens)

    def openai(self) -> dict[str, Any]:
        """Chat and text completions' `usage`."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
        }

    def responses(self) -> dict[str, Any]:
        return {
            "input_tokens": self.prompt_tokens, "input_tokens_details": {"cached_tokens": self.cached_tokens},
            "output_tokens": self.completion_tokens, "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }

    def anthropic(self, pinned_tokens: int, block_size: int) -> dict[str, int]:
        """Anthropic's split of the prompt, which sums to it: `cache_read_input_tokens` (served by the cache),
        `cache_creation_input_tokens` (written at a `cache_control` breakpoint: the tokens up to the last breakpoint
        that the engine really retained, ``pinned_tokens``, that were not read; a pin the retention cap or the
        tenant's share refused writes nothing) and `input_tokens` (the rest). As Anthropic reports them: a prefix up
        to the last breakpoint that the cache holds is read whole (an identical repeat creates 0), although kvserve
        recomputes the part of it in its last, partly filled block (only full blocks are shared); a breakpoint
        prefix shorter than one block is never cached (as below Anthropic's minimum length): neither read nor
        written. Without breakpoints, what every request's full blocks gave is read, and nothing is written: only a
        breakpoint's pin counts as a cache write."""
        prompt, cached, pinned = self.prompt_tokens, self.cached_tokens, pinned_tokens
        cacheable = min(pinned, prompt - 1) // block_size * block_size  # the breakpoint prefix's whole blocks
        read, created = cached, 0
        if cacheable and cached >= cacheable:
            read = max(cached, pinned)
        elif cacheable:
            created = pinned - cached
        return {
            "input_tokens": prompt - read - created,
            "cache_creation_input_tokens": created,
            "cache_read_input_tokens": read,
            "output_tokens": self.completion_tokens,
        }


async def _compile_constraint(ctx: ServingContext, prompt: Generation) -> None:
    """Compile the prompt's grammar, if any, before the engine sees it (in a compile worker, within the time limit:
    on the engine thread a new grammar would stall every running request; the engine then finds it cached). A
    grammar that cannot be compiled is a 400 naming its field. An optional grammar (it only guards tool calls the
    model may open under tool_choice auto) is never waited for: not compiled yet, the request runs unconstrained, as
    without a grammar, while it compiles in the background for the next request (server/pipeline/optional_grammars.py)."""
    params = prompt.request.params
    if params.structured_output is None:
        return
    if prompt.constraint_optional:
        missing = ctx.optional_grammar_missing(params.structured_output, prompt.request.cache_salt)
        if missing is not None:
            log.warning("tool calls run unconstrained: %s", missing)
            prompt.request.params = dataclasses.replace(params, structured_output=None)
        return
    try:
        await ctx.compile_grammar(params.structured_output, prompt.request.cache_salt)
    except CompileCancelled as exc:
        raise APIError(503, f"the grammar was not compiled: {exc}", type="server_error",
                       code="server_shutting_down") from None
    except ValueError as exc:
        raise APIError(400, str(exc), param=prompt.constraint_param) from None


async def submit(ctx: ServingContext, prompts: list[Generation]) -> RequestStream:
    """Prepare the requests (validation, block hashes: off the engine thread and the event loop), compile their
    grammars, then hand them to the engine; rejections (prompt too long for the context or the KV pool) are 400s,
    before any grammar compiles (a required tool call's grammar could take its whole time limit first). The
    tenant's sequences count against its budget until the stream closes (429 past it)."""
    requests = [p.request for p in prompts]
    release = ctx.tenant_slots.acquire(requests[0].cache_salt, sum(r.params.n for r in requests))
    try:
        await ctx.prepare(ctx.engine.prepare, requests)  # a prompt too long is refused before its grammar compiles
        for prompt in prompts:
            await _compile_constraint(ctx, prompt)
        stream = await ctx.engine.submit(requests)
    except RequestRejected as exc:
        release()
        raise APIError(400, str(exc), code=exc.code) from None
    except EngineDeadError as exc:
        release()
        raise APIError(503, str(exc), type="server_error", code="engine_unavailable") from None
    except BaseException:
        release()
        raise
    stream.on_close(release)
    return stream


async def outputs(stream: RequestStream, prompts: list[Generation]) -> AsyncIterator[tuple[int, SequenceOutput]]:
    """(prompt index, output) for every sequence output, in step order (each taken into its prompt's choices first),
    but those of choices that had ended; aborts what is left if the consumer stops.
    A sequence that failed in the engine (alone: the others went on) fails its HTTP request with a 500."""
    index = {p.request.request_id: i for i, p in enumerate(prompts)}
    try:
        async for batch in stream:
            for out in batch:
                if out.finish_reason is FinishReason.ERROR:
                    raise APIError(500, f"the request failed in the engine: {out.error}", type="server_error",
                                   code="request_failed")
                i = index[out.request_id]
                if prompts[i].observe(out):
                    yield i, out
    except EngineDeadError as exc:
        raise APIError(500, str(exc), type="server_error", code="engine_error") from None
    finally:
        stream.abort()


def record(
    ctx: ServingContext, endpoint: str, body: dict[str, Any], prompts: list[Generation], session: str | None = None,
    turn: Turn | None = None,
) -> None:
    """A request finished: record it (`--record`) and tell the context's ``on_finished`` listener (the inspector with
    `--ui`). ``turn``: the request's conversation (not for raw text prompts), for the inspector's explanation of what
    changed."""
    if ctx.on_finished is not None:
        ctx.on_finished(ctx, endpoint, prompts, session, turn)
    if ctx.recorder is None:
        return
    for p in prompts:
        ctx.recorder.write(RequestRecord(
            request_id=p.request.request_id,
            endpoint=endpoint,
            model=ctx.model_name,
            body=body,
            prompt_token_ids=p.request.prompt_token_ids,
            output_token_ids=p.first_choice.token_ids,
            cached_tokens=p.num_cached_tokens,
            cache_salt=p.request.cache_salt,
            session=session,
            finish_reason=p.first_choice.finish_reason or "abort",
            timings=timing_fields(p.timings),
            time=time.time(),
            speculation=p.speculation.as_dict() if p.speculation is not None else None,
        ))
