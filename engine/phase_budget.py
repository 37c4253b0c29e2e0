"""A budget on one phase of a sequence's output, enforced by forcing tokens: "after ``budget`` tokens of the phase,
force ``forced_token_ids``". The engine knows nothing of what the phase means; the server makes a thinking budget of
it (the phase: a model's reasoning between its ``<think>`` and ``</think>``; the forced tokens: a short closing phrase
and the model's own end of thinking, as llama.cpp's --reasoning-budget does; server/pipeline/reasoning_budget.py).

A phase opens when the output writes ``start_token_ids`` (or at the first output token, ``open_at_start``: the
prompt left it open) and ends when the output writes ``end_token_ids``, once. The tokens written inside it count
against the budget (its end marker included); once ``budget`` are written and it has not ended, each next token is
the next of ``forced_token_ids``, which end with the phase's end, so a phase holds at most ``budget`` of the model's
own tokens plus the forced ones.

`PhaseTracker` follows one sequence's output, each token once (the scheduler's side, torch-free): which token the
next sample must be, and how many the model may still write freely (speculative drafts stop short of the budget).
Plain data and integers: it crosses to a core process with the sampling parameters.
"""
from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PhaseBudget:
    budget: int  # tokens the model may write inside the phase before the forcing starts
    forced_token_ids: tuple[int, ...]  # forced once the budget is spent: they end the phase (its end marker last)
    end_token_ids: tuple[int, ...]  # the phase's end as the model writes it
    start_token_ids: tuple[int, ...] = ()  # the phase's start as the model writes it
    open_at_start: bool = False  # the prompt left the phase open: the first output token is inside it

    def __post_init__(self) -> None:
        if self.budget < 0:
            raise ValueError(f"a phase budget must be >= 0 tokens, got {self.budget}")
        if not self.end_token_ids or tuple(self.forced_token_ids[-len(self.end_token_ids):]) != self.end_token_ids:
            raise ValueError("a phase budget's forced tokens must end with the phase's end tokens")
        if not (self.open_at_start or self.start_token_ids):
            raise ValueError("a phase budget needs start tokens unless the phase is open at the start")


class _State(enum.Enum):
    BEFORE = "before"  # the phase has not opened
    INSIDE = "inside"
    FORCING = "forcing"  # the budget is spent: the forced tokens are being written
    DONE = "done"  # it ended (it never opens twice)


class PhaseTracker:
    """One sequence's output through its `PhaseBudget`: call `advance` with the sequence's tokens (prompt then
    output) whenever some were added; each output token is looked at once."""

    def __init__(self, rule: PhaseBudget, num_prompt_tokens: int) -> None:
        self.rule = rule
        self.state = self._opened() if rule.open_at_start else _State.BEFORE
        self.num_inside = 0  # tokens the model wrote inside the phase
        self.num_forced = 0  # forced tokens written so far
        self._next = num_prompt_tokens  # the next token to look at

    @property
    def active(self) -> bool:
        """It may still force a token (its phase has not ended): the engine needs each step's tokens back first."""
        return self.state is not _State.DONE

    def advance(self, token_ids: Sequence[int]) -> None:
        rule = self.rule
        for i in range(self._next, len(token_ids)):
            if self.state is _State.BEFORE:
                if _ends_with(token_ids, i + 1, rule.start_token_ids):
                    self.state = self._opened()
            elif self.state is _State.INSIDE:
                self.num_inside += 1
                if _ends_with(token_ids, i + 1, rule.end_token_ids):
                    self.state = _State.DONE
                elif self.num_inside >= rule.budget:
                    self.state = _State.FORCING
            elif self.state is _State.FORCING:
                self.num_forced += 1
                if self.num_forced == len(rule.forced_token_ids):
                    self.state = _State.DONE
        self._next = max(self._next, len(token_ids))

    def forced_token(self) -> int | None:
        """The token the next sample must be (None: the model's own choice)."""
        return self.rule.forced_token_ids[self.num_forced] if self.state is _State.FORCING else None

    def _opened(self) -> _State:
        return _State.INSIDE if self.rule.budget else _State.FORCING

    def free_tokens_left(self) -> int | None:
        """Tokens the model may still write before one is forced (None: no bound now, the phase is not open or is
        over; 0: the next is forced). A phase not yet open counts as open: a draft may open it."""
        if self.state is _State.DONE:
            return None
        if self.state is _State.FORCING:
            return 0
        return max(0, self.rule.budget - self.num_inside)


def _ends_with(token_ids: Sequence[int], end: int, marker: tuple[int, ...]) -> bool:
    n = len(marker)
    return n > 0 and end >= n and tuple(token_ids[end - n : end]) == marker
