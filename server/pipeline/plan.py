"""The planner every API shares: a `Turn` (from chat completions, Anthropic Messages or OpenAI Responses) rendered
into the prompt text its model was trained on, constrained (the grammar that guarantees `tool_choice` and
`response_format`), tokenized, given its cache retention (breakpoint pins, snapshot hints, a session's hold) and made
one engine request: a `Plan`. The API adapters (server/api/) make the turn and format what comes back; this module
never sees an API's shapes. Template kwargs that switch thinking and reasoning effort are read here the way each
family's template reads them.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from engine.phase_budget import PhaseBudget
from engine.multimodal import expanded_count
from server.api.protocol import APIError
from server.cache.cache_control import breakpoint_pins, chat_breakpoints, snapshot_hints
from server.cache.normalize import normalize_for_cache
from server.http.limits import check_request, check_sampling, check_scored
from server.parsing import default_thinking
from server.parsing.registry import active_thinking
from server.pipeline.reasoning_budget import reasoning_tokens, request_budget, thinking_markers, with_budget
from server.parsing.constraint import ConstraintError, output_constraint
from server.pipeline.async_engine import EngineRequest
from server.pipeline.context import ServingContext, new_request_id
from server.pipeline.generation import Generation, record
from server.pipeline.images import expand, prompt_text, turn_images
from server.pipeline.turn import Turn
from server.rendering import serving_template_kwargs

# The template kwarg that switches thinking, per family with a switch.
_THINKING_SWITCH = {
    "qwen3": "enable_thinking", "qwen3.6": "enable_thinking",
    "deepseek-v3.1": "thinking", "deepseek-v3.2": "thinking", "deepseek-v4": "thinking",
    "glm-4.7": "enable_thinking", "gemma4": "enable_thinking",
}
# Families whose template thinks only for a truthy switch (Gemma 4: `enable_thinking is defined and enable_thinking`)
_TRUTHY_SWITCH = ("gemma4",)
# Families whose template takes a `reasoning_effort` kwarg of its own.
_EFFORT_KWARG_FAMILIES = ("deepseek-v4",)
# gpt-oss always reasons, at the effort its system message states (`Reasoning: low|medium|high`): an API's effort,
# the lowest ones as low, anything above high as high
_HARMONY_EFFORTS = {"none": "low", "minimal": "low", "low": "low", "medium": "medium"}
OFF_EFFORTS = ("none", "minimal")
# Kimi-K3's thinking_effort (low, medium, high, max; kvserve's K3 always thinks)
_K3_EFFORTS = {"none": "low", "minimal": "low", "low": "low", "medium": "medium", "high": "high"}


@dataclass
class Plan:
    """A turn, rendered and tokenized, ready for the engine."""

    request_id: str
    created: int
    turn: Turn  # as the engine runs it: a named cache's messages first
    body: dict[str, Any]
    generation: Generation  # the engine request and what comes back for it
    thinking: bool  # this request's output starts with / may contain reasoning
    endpoint: str = "chat"  # which API it came from, for the record
    pinned_tokens: int = 0  # prompt tokens up to the last cache_control breakpoint
    # its thinking as a phase of the output's tokens (server/pipeline/reasoning_budget.py; None: it does not think)
    reasoning: PhaseBudget | None = None


    def reasoning_tokens(self) -> int:
        """Of its output so far, the thinking tokens (every choice's)."""
        return reasoning_tokens(self.reasoning, [c.token_ids for c in self.generation.choices])


def request_thinking(family: str, template_kwargs: dict[str, Any]) -> bool:
    """Whether thinking is on, read the way the templates read it: Qwen3 turns it off only with an explicit
    `enable_thinking: false`, DeepSeek-V3.1 turns it on with a truthy `thinking`."""
    if "enable_thinking" in template_kwargs:
        value = template_kwargs["enable_thinking"]
        return bool(value) if family in _TRUTHY_SWITCH else value is not False
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
    if family == "gpt-oss":
        kwargs["reasoning_effort"] = _HARMONY_EFFORTS.get(effort, "high")
    if family == "kimi-k3":  # always thinks, at the effort its template states (max unless told): the lowest as low
        kwargs["thinking_effort"] = _K3_EFFORTS.get(effort, "max")
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


def render_turn(ctx: ServingContext, turn: Turn) -> str:
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


def turn_prompt_text(ctx: ServingContext, turn: Turn, cache_salt: str | None) -> tuple[Turn, str]:
    """The turn as the engine runs it (a named cache's messages first, its breakpoints with them; by default
    those on chat content parts), and its prompt text."""
    ctx.check_model(turn.model)
    if turn.breakpoints is None:
        turn = replace(turn, breakpoints=chat_breakpoints(turn.messages, turn.tools))
    turn = with_cached_content(ctx, turn, cache_salt)
    return turn, render_turn(ctx, turn)


def plan_turn(ctx: ServingContext, turn: Turn, body: dict[str, Any], cache_salt: str | None, created: int,
              *, endpoint: str = "chat", id_prefix: str = "chatcmpl") -> Plan:
    """A turn (from any API) rendered, constrained, tokenized and made an engine request."""
    # Messages and tools are checked where they are rendered (`render_turn`).
    check_request(ctx.settings.limits, response_format=turn.response_format,
                  structured_outputs=turn.structured_outputs)
    check_sampling(ctx.settings.limits, turn.sampling)
    turn, images = turn_images(ctx.images, turn)  # each image part -> the template's placeholder text
    turn, text = turn_prompt_text(ctx, turn, cache_salt)
    thinking = request_thinking(ctx.family, turn.template_kwargs)
    active = active_thinking(ctx.family, thinking)
    markers = thinking_markers(text, ctx.encode, active.tags) if active else None
    budget = request_budget(turn.sampling.reasoning_budget, turn.sampling.reasoning_effort,
                            ctx.settings.reasoning_budget) if markers is not None else None
    try:
        constraint = output_constraint(
            ctx.family, turn.tools, turn.tool_choice, turn.parallel_tool_calls, turn.response_format,
            reasoning=thinking, structured_outputs=turn.structured_outputs,
        )
    except ConstraintError as exc:
        raise APIError(400, str(exc), param=exc.param) from None
    session = (cache_salt, turn.session) if turn.session else None
    tokens = ctx.encode_turn(prompt_text(ctx.images, text, images), session)
    prompt_ids = tokens.token_ids
    prompt = expand(ctx.images, prompt_ids, images)  # each placeholder token -> its image's tokens
    check_scored(ctx.settings.limits, [len(prompt.token_ids)], turn.sampling.n, prompt_logprobs=turn.prompt_logprobs)
    params = ctx.sampling_params(
        turn.sampling, len(prompt.token_ids), skip_special_tokens=False, num_logprobs=turn.num_top_logprobs,
        structured_output=constraint, prompt_logprobs=turn.prompt_logprobs, session=turn.session,
        phase_budget=None if budget is None else with_budget(markers, budget),
    )
    cut = lambda m, t: _render(ctx, m, t, False, turn.template_kwargs)  # noqa: E731 - a conversation cut, rendered
    pins = tuple(replace(p, num_tokens=expanded_count(prompt, p.num_tokens))
                 for p in breakpoint_pins(turn.breakpoints or [], text, prompt_ids, cut, ctx.encode))
    hints = (tuple(expanded_count(prompt, n) for n in snapshot_hints(turn.messages, turn.tools, text, prompt_ids, cut,
                                                                     ctx.encode))
             if ctx.recurrent_state else ())
    request_id = new_request_id(id_prefix)
    request = EngineRequest(request_id, prompt.token_ids, params, cache_salt,
                            ctx.retention(pins, turn.session, cache_salt, hints), images=prompt.images,
                            known_block_hashes=[] if prompt.images else tokens.known_block_hashes)
    tokens.remember(request)
    generation = Generation(request, constraint_param="tools", constraint_optional=guards_only_auto_calls(turn))
    return Plan(request_id, created, turn, body, generation, thinking, endpoint,
                max((p.num_tokens for p in pins), default=0), markers)


def record_plan(ctx: ServingContext, plan: Plan) -> None:
    record(ctx, plan.endpoint, plan.body, [plan.generation], session=plan.turn.session, turn=plan.turn)
