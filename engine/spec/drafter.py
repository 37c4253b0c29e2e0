"""The scheduler's side of speculative decoding: which sequences draft, how many tokens, and what they propose.

Torch-free (the scheduler imports no torch). Every sequence that speculates gets an `NgramIndex` over its tokens,
extended lazily as tokens are accepted; every session (the tenant's cache salt plus the server's session id) gets a
`SuffixTree` over the text of its finished requests. The `suffix` method proposes from the session's tree and falls
back to the sequence's own prompt lookup where the tree has no match. The `mtp` method proposes what the model's MTP
layer drafted in the runner after the sequence's last step (`engine/spec/mtp.py`), handed back with its tokens.

Speculation turns itself down as the batch grows: verifying drafts costs compute that a large batch already
saturates, so the step's drafts are capped at ``draft_budget`` tokens, shared by the decoding sequences
(``k = min(num_speculative_tokens, draft_budget // num_decodes)``; no drafts once that reaches 0).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Literal, Sequence, get_args

from engine.outputs import DraftStats
from engine.spec.ngram import NgramIndex
from engine.spec.suffix import SuffixTree

Method = Literal["off", "ngram", "suffix", "mtp"]
METHODS: tuple[str, ...] = get_args(Method)
MAX_SESSIONS = 256  # session trees kept (least recently used dropped)
MAX_DOCUMENT_TOKENS = 4096  # of a finished request's new text, the tail that goes into its session's tree


@dataclass
class Drafter:
    num_speculative_tokens: int = 4
    draft_budget: int = 16
    min_n: int = 2
    max_n: int = 4
    suffix_depth: int = 24
    _indexes: dict[str, NgramIndex] = field(default_factory=dict, repr=False)
    _sessions: OrderedDict[tuple[str | None, str | None], tuple[SuffixTree, list[int]]] = field(
        default_factory=OrderedDict, repr=False)
    stats: dict[str, DraftStats] = field(default_factory=lambda: {m: DraftStats() for m in METHODS[1:]})
    request_stats: dict[str, DraftStats] = field(default_factory=dict)  # of the live sequences that speculate
    # mtp: per sequence, the drafts the runner made after its last step, and how many tokens it had then
    _offered: dict[str, tuple[int, list[int]]] = field(default_factory=dict, repr=False)

    def drafts_per_sequence(self, num_decodes: int) -> int:
        if num_decodes <= 0:
            return self.num_speculative_tokens
        return min(self.num_speculative_tokens, self.draft_budget // num_decodes)

    def propose(self, seq_id: str, method: Method, tokens: Sequence[int], k: int,
                session: tuple[str | None, str | None]) -> list[int]:
        if method == "off" or k <= 0:
            return []
        if method == "mtp":  # drafted for exactly these tokens, or not at all
            length, drafts = self._offered.get(seq_id, (-1, []))
            return drafts[:k] if length == len(tokens) else []
        index = self._indexes.get(seq_id)
        if index is None:
            index = self._indexes[seq_id] = NgramIndex(self.min_n, self.max_n)
        index.extend(tokens[len(index.tokens):])
        if method == "suffix":
            entry = self._sessions.get(session)
            if entry is not None:
                self._sessions.move_to_end(session)
                drafts = entry[0].propose(tokens[-self.suffix_depth:], k)
                if drafts:
                    return drafts
        return index.propose(k)

    def offer(self, seq_id: str, num_tokens: int, drafts: list[int]) -> None:
        """The MTP layer drafted ``drafts`` to follow the sequence's first ``num_tokens`` tokens."""
        self._offered[seq_id] = (num_tokens, drafts)

    def record(self, seq_id: str, method: Method, drafted: int, emitted: int) -> None:
        """A step of a speculating sequence came back: ``drafted`` drafts verified, ``emitted`` tokens appended."""
        self.stats[method].record(drafted, emitted)
        mine = self.request_stats.get(seq_id)
        if mine is None:
            mine = self.request_stats[seq_id] = DraftStats()
        mine.record(drafted, emitted)

    def finished(self, seq_id: str, tokens: Sequence[int] | None, session: tuple[str | None, str | None]) -> None:
        """A sequence ended: its index and counters go; its text (``tokens``, for the suffix method) joins its
        session's tree. An agent's next prompt repeats the last one, so only what is new since the session's
        previous document is added (its tail, bounded)."""
        self._indexes.pop(seq_id, None)
        self._offered.pop(seq_id, None)
        self.request_stats.pop(seq_id, None)
        if tokens is None:
            return
        entry = self._sessions.get(session)
        if entry is None:
            entry = self._sessions[session] = (SuffixTree(max_depth=self.suffix_depth), [])
        self._sessions.move_to_end(session)
        while len(self._sessions) > MAX_SESSIONS:
            self._sessions.popitem(last=False)
        tree, previous = entry
        common = _common_prefix(previous, tokens)
        tree.add(tokens[max(common, len(tokens) - MAX_DOCUMENT_TOKENS):])
        self._sessions[session] = (tree, list(tokens))

    def session_tree(self, session: tuple[str | None, str | None]) -> SuffixTree | None:
        entry = self._sessions.get(session)
        return entry[0] if entry else None


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    lo, hi = 0, n  # binary search on prefix equality: O(log n) slice compares, each done in C
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
