"""A turn: one chat generation request in no API's shape, what every chat-like API's adapter makes of its request
(chat completions: `server.api.chat.chat_turn`, Anthropic Messages: `server.api.messages_input.to_turn`, OpenAI Responses:
`server.api.responses_input.to_turn`) and what `server.pipeline.plan.plan_turn` renders, constrains and submits. The adapters have
validated their own requests; a turn is plain data and is not validated again.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from server.cache.cache_control import Breakpoint
    from server.api.protocol import SamplingFields


@dataclass(frozen=True)
class Sampling:
    """How to sample, as the request asked it (None: the server's default; `ServingContext.sampling_params`)."""

    max_tokens: int | None = None  # None: the room the context has left (capped by --max-output-tokens)
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    speculative: str | None = None  # the proposer (--speculative), where the API lets a request pick it
    # Thinking tokens at most (Anthropic's budget_tokens), else the effort's (server/pipeline/reasoning_budget.py)
    reasoning_budget: int | None = None
    reasoning_effort: str | None = None

    @classmethod
    def of(cls, req: SamplingFields, max_tokens: int | None) -> Sampling:
        """The sampling fields chat and text completions share (their own spelling of the token limit)."""
        return cls(
            max_tokens=max_tokens, n=req.n, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
            min_p=req.min_p, seed=req.seed, stop=(req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ()),
            stop_token_ids=tuple(req.stop_token_ids or ()), presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
            ignore_eos=req.ignore_eos, speculative=req.speculative,
        )


@dataclass(frozen=True)
class Turn:
    """The conversation so far and what the reply must be: messages and tools as the chat templates take them,
    the constraints on the reply, sampling, what to return besides the reply, and what to keep in the cache."""

    messages: list[dict[str, Any]]
    model: str | None = None  # as the request named it (checked against the served model)
    tools: list[dict[str, Any]] | None = None  # chat-completions functions
    tool_choice: str | dict[str, Any] | None = None  # chat's spelling: auto, none, required, or a named function
    parallel_tool_calls: bool | None = None  # False: at most one call
    response_format: dict[str, Any] | None = None  # chat's: text, json_object or json_schema
    structured_outputs: dict[str, Any] | None = None  # vLLM's: regex, grammar, json or choice
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # thinking, effort, and the client's own
    add_generation_prompt: bool = True
    cached_content: str | None = None  # a named cache the turn continues (server/cache/named_caches.py)
    sampling: Sampling = Sampling()
    num_top_logprobs: int | None = None  # None: no logprobs
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob and this many alternatives
    include_usage: bool = False  # a streamed reply ends with its usage
    session: str | None = None  # the agent session, as the client named it (recorded; its blocks are held)
    breakpoints: list[Breakpoint] | None = None  # cache_control marks (None: those on chat content parts)
    compaction_epoch: int = 0  # compactions the conversation went through (server/api/compaction.py; the inspector)
    # Anthropic's `applied_edits`: what the server cleared before rendering (server/api/context_edits.py); None:
    # the request asked for no context management
    context_edits: tuple[dict[str, Any], ...] | None = None

    @property
    def structured_answer(self) -> bool:
        """The answer must be JSON (`response_format`) or match a grammar (`structured_outputs`)."""
        return self.structured_outputs is not None or (self.response_format or {}).get("type", "text") != "text"
