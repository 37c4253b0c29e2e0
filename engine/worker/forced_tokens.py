"""Forced tokens: a logits processor that leaves each forced row one choice, the token its phase budget forces
(engine/phase_budget.py; the engine decides which, `LLMEngine._forced_tokens`). Applied after any grammar's masks,
like them on every position of a row (a forced row has no drafts: the scheduler stops drafts short of a budget)."""
from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence

import torch


def force_tokens(forced: Mapping[str, int]) -> Callable[[torch.Tensor, Sequence[str], Sequence[int] | None], None]:
    """A processor for the runner: ``logits`` rows sample for ``seq_ids[j]``, ``counts[j]`` rows each (default 1);
    a forced sequence's rows keep only its token (logit 0, every other -inf), in place."""
    def apply(logits: torch.Tensor, seq_ids: Sequence[str], counts: Sequence[int] | None) -> None:
        start = 0
        for seq_id, n in zip(seq_ids, counts if counts is not None else itertools.repeat(1)):
            token = forced.get(seq_id)
            if token is not None:
                rows = logits[start : start + n]
                rows.fill_(float("-inf"))
                rows[:, token] = 0.0
            start += n
    return apply
