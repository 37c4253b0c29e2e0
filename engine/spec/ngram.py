"""Prompt lookup (n-gram) drafts: find the most recent earlier occurrence of the request's last n tokens
(n from `max_n` down to `min_n`) and propose the tokens that followed it.

The index is incremental: each appended token records, for every n, where that n-gram last ended, so a proposal
is O(max_n + k) however long the context is, and a step's host work grows with the tokens it appends, not with the
context (an agent's prompt is often 10-40k tokens).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence


@dataclass
class NgramIndex:
    """One sequence's n-gram index over its tokens (prompt then output), extended as tokens are accepted."""

    min_n: int = 2
    max_n: int = 4
    tokens: list[int] = field(default_factory=list)
    # n-gram -> end index (inclusive) of its latest occurrence in `tokens`
    _latest: dict[tuple[int, ...], int] = field(default_factory=dict, repr=False)
    # for the current suffix of each length n: where the same n-gram ended before (None: never)
    _previous: dict[int, int | None] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={self.min_n}, max_n={self.max_n}")
        initial, self.tokens = self.tokens, []
        self.extend(initial)

    def extend(self, new_tokens: Sequence[int]) -> None:
        tokens, latest = self.tokens, self._latest
        for token in new_tokens:
            tokens.append(token)
            end = len(tokens) - 1
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                key = tuple(tokens[end - n + 1 : end + 1])
                self._previous[n] = latest.get(key)
                latest[key] = end

    def truncate(self, length: int) -> None:
        """Forget tokens beyond `length` (a preempted sequence resumes from its kept tokens): rebuilt from scratch,
        which is rare and O(length)."""
        if length < len(self.tokens):
            kept = self.tokens[:length]
            self.tokens, self._latest, self._previous = [], {}, {}
            self.extend(kept)

    def propose(self, k: int) -> list[int]:
        """Up to `k` drafts: the continuation of the longest suffix n-gram seen before (empty if none)."""
        if k <= 0:
            return []
        for n in range(min(self.max_n, len(self.tokens)), self.min_n - 1, -1):
            end = self._previous.get(n)
            if end is not None:
                # The continuation may run into the current suffix itself (a repeating pattern): that is fine.
                return self.tokens[end + 1 : end + 1 + k]
        return []
