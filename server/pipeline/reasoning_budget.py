"""Thinking budgets: how many tokens a request's model may think, enforced by the engine (engine/phase_budget.py),
and how many it did (`usage`). Every family that thinks writes its reasoning between `<think>` and `</think>`
(Qwen3, Qwen3.5 / 3.6, DeepSeek V3.1 / R1 / V3.2 / V4, GLM-4.7): the budget is a `PhaseBudget` on those tokens of
the served tokenizer. After the budget, the engine forces a short closing phrase and the model's own `</think>`,
as llama.cpp's --reasoning-budget does; the model then answers on its own.

A request's budget, the first that applies:
- Anthropic `thinking: {"type": "enabled", "budget_tokens": N}`: N tokens.
- An effort: OpenAI `reasoning_effort` (chat completions), Responses `reasoning.effort`, Anthropic
  `output_config.effort`: `low` 1,024, `medium` 4,096, `high` 16,384 tokens (`EFFORT_BUDGETS`); `xhigh` and `max`
  are unbounded; `none` and `minimal` turn thinking off in the template (server/pipeline/plan.py, `effort_kwargs`).
- `kvserve serve --reasoning-budget N`, the server's default (unset: unbounded).
A budget applies only when the request thinks. Where the prompt leaves `<think>` open (the families whose generation
prompt opens it), the output starts inside the thinking; otherwise the thinking starts when the model writes
`<think>` (Qwen3). The thinking tokens (the model's, the forced ones, its `</think>`) are reported as
`completion_tokens_details.reasoning_tokens` (chat) and `output_tokens_details.reasoning_tokens` (Responses);
Anthropic's usage has no such field (its `output_tokens` count them).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

from engine.phase_budget import PhaseBudget, PhaseTracker
from server.parsing.reasoning import THINK_CLOSE, THINK_OPEN

EFFORT_BUDGETS = {"low": 1024, "medium": 4096, "high": 16384}
UNBOUNDED_EFFORTS = ("xhigh", "max")
# What the engine makes the model write when its budget is spent, before its own </think>
CLOSING_PHRASE = "\n\nI have used up my thinking budget, so I will answer now.\n"


def effort_budget(effort: str | None) -> int | None:
    """The thinking budget an effort asks for (None: unbounded, or no effort given)."""
    return EFFORT_BUDGETS.get(effort) if effort else None


def request_budget(budget_tokens: int | None, effort: str | None, server_default: int | None) -> int | None:
    """A request's thinking budget in tokens (None: unbounded): its own, else its effort's, else the server's."""
    if budget_tokens is not None:
        return budget_tokens
    if effort in UNBOUNDED_EFFORTS:
        return None
    return effort_budget(effort) if effort in EFFORT_BUDGETS else server_default


def thinking_markers(prompt_text: str, encode: Callable[[str], list[int]],
                     tags: tuple[str, str] = (THINK_OPEN, THINK_CLOSE)) -> PhaseBudget:
    """The thinking of a request whose prompt is ``prompt_text``, as a phase of the served tokenizer's tokens (its
    budget unbounded: `with_budget` sets one): open at the start when the prompt leaves `<think>` (or the family's
    opening ``tags[0]``) open."""
    opening, closing = tags
    end = tuple(encode(closing))
    return PhaseBudget(budget=2**31 - 1, forced_token_ids=tuple(encode(CLOSING_PHRASE)) + end, end_token_ids=end,
                       start_token_ids=tuple(encode(opening)),
                       open_at_start=prompt_text.rfind(opening) > prompt_text.rfind(closing))


def with_budget(markers: PhaseBudget, budget: int) -> PhaseBudget:
    return dataclasses.replace(markers, budget=budget)


def reasoning_tokens(markers: PhaseBudget | None, outputs: Iterable[list[int]]) -> int:
    """How many output tokens were thinking (the model's, the forced ones and the end), summed over ``outputs``
    (each a choice's token ids)."""
    if markers is None:
        return 0
    total = 0
    for token_ids in outputs:
        tracker = PhaseTracker(markers, 0)
        tracker.advance(token_ids)
        total += tracker.num_inside + tracker.num_forced
    return total
