"""What changes in a running sequence every step, as arrays: its known tokens, its tokens in flight (placeholders),
its computed tokens and its newest sampled tokens. One *entry* per running sequence, fixed while it runs.

A steady decode step reads and writes these for the whole batch with a few numpy calls and touches no `Sequence`:
the scheduler's columns (engine/sched/running_columns.py) gather them by entry. A running `Sequence` reads its counters
through its entry (`Sequence.num_computed_tokens` and the rest are properties), so every reader sees the same values.
Sampled tokens land in ``recent`` first and join the sequence's token list when anyone reads it (`flush`), and every
entry's are flushed before ``recent`` could overflow. (With the caches cold after a forward each numpy call costs
microseconds, so a step makes few, and plain ones: 1-D gathers and scatters.) `attach` copies a sequence's state in
when it starts running; `detach` copies it back out when it stops.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from engine.sched.sequence import Sequence

RECENT_TOKENS = 64  # sampled tokens an entry holds before its sequence's token list must take them


class StepState:
    def __init__(self, capacity: int) -> None:
        capacity = max(capacity, 1)
        self.num_known = np.zeros(capacity, dtype=np.int64)  # tokens known on the host (the list's and recent's)
        self.num_placeholders = np.zeros(capacity, dtype=np.int64)  # sampled in steps whose output is not back
        self.num_computed = np.zeros(capacity, dtype=np.int64)
        self.num_recent = np.zeros(capacity, dtype=np.int64)  # of the known tokens, those still in ``recent``
        self.recent = np.zeros((capacity, RECENT_TOKENS), dtype=np.int64)
        self.token_lists: list[list[int] | None] = [None] * capacity  # each entry's sequence's token list
        self._free = list(range(capacity - 1, -1, -1))  # free entries, the lowest last (taken first)
        self._appends = 0  # `append` calls since every entry's recent tokens were flushed

    def attach(self, seq: Sequence) -> int:
        """``seq`` starts running: its counters move into an entry (returned), which it reads through."""
        if not self._free:
            self._grow()
        entry = self._free.pop()
        self.num_known[entry] = len(seq._tokens)
        self.num_placeholders[entry] = seq._num_placeholders
        self.num_computed[entry] = seq._num_computed
        self.num_recent[entry] = 0
        self.token_lists[entry] = seq._tokens
        seq.step_state, seq.entry = self, entry
        return entry

    def detach(self, seq: Sequence) -> None:
        """``seq`` stops running (finished or preempted): its counters and tokens move back into it."""
        entry = seq.entry
        self.flush(entry)
        self.token_lists[entry] = None
        seq._num_placeholders = int(self.num_placeholders[entry])
        seq._num_computed = int(self.num_computed[entry])
        seq.step_state, seq.entry = None, -1
        self._free.append(entry)

    def flush(self, entry: int) -> None:
        """Move the entry's recent tokens into its sequence's token list."""
        n = self.num_recent.item(entry)
        if n:
            self.token_lists[entry] += self.recent[entry, :n].tolist()
            self.num_recent[entry] = 0

    def scheduled(self, entries: np.ndarray, lengths: np.ndarray) -> None:
        """Each of ``entries`` (distinct) had its last token scheduled, which samples the next: computed up to
        ``lengths``, one more token in flight."""
        self.num_computed[entries] = lengths
        self.num_placeholders[entries] += 1

    def append(self, entries: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """One sampled token for each of ``entries`` (distinct), replacing a placeholder; returns the sequences' new
        lengths (known tokens)."""
        recent = self.num_recent[entries]
        self.recent[entries, recent] = tokens
        recent += 1
        self.num_recent[entries] = recent
        lengths = self.num_known[entries] + 1
        self.num_known[entries] = lengths
        self.num_placeholders[entries] -= 1
        self._appends += 1
        if self._appends == RECENT_TOKENS:  # an entry may have no room left for the next token
            self._appends = 0
            for entry, token_list in enumerate(self.token_lists):
                if token_list is not None:
                    self.flush(entry)
        return lengths

    def _grow(self) -> None:
        """More running sequences than planned for: double every array."""
        old = len(self.num_known)
        for name in ("num_known", "num_placeholders", "num_computed", "num_recent", "recent"):
            array = getattr(self, name)
            setattr(self, name, np.concatenate([array, np.zeros_like(array)]))
        self.token_lists += [None] * old
        self._free = list(range(2 * old - 1, old - 1, -1))
