"""Suffix decoding (after Snowflake's SuffixDecoding / Arctic Inference): drafts from a suffix tree over a session's
earlier prompts and replies, so an agent's repeated paths, code and tool-call shapes are proposed without a model.

The tree holds every suffix of every document, cut to `max_depth` tokens, with a count per node (how many suffixes
pass through it). A proposal matches the longest suffix of the request's recent tokens that the tree holds (at most
`max_depth - k` tokens, so `k` tokens of continuation fit below it) and then follows the most frequent child at each
level. Documents are added as requests finish and the oldest are removed past `max_documents`, so memory stays
bounded: a document of L tokens adds at most L * max_depth nodes.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Sequence


class _Node:
    __slots__ = ("children", "count")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        self.count = 0


@dataclass
class SuffixTree:
    max_depth: int = 24
    max_documents: int = 64  # the oldest documents are forgotten beyond this many
    min_match: int = 2  # a match shorter than this proposes nothing (one token says too little)
    min_count_fraction: float = 0.0  # stop drafting where the best child's share of its parent falls below this
    _root: _Node = field(default_factory=_Node, repr=False)
    _documents: deque[tuple[int, ...]] = field(default_factory=deque, repr=False)

    @property
    def num_documents(self) -> int:
        return len(self._documents)

    @property
    def num_nodes(self) -> int:
        stack, total = [self._root], 0
        while stack:
            node = stack.pop()
            total += len(node.children)
            stack.extend(node.children.values())
        return total

    def add(self, tokens: Sequence[int]) -> None:
        """Insert every suffix of `tokens` (cut to max_depth); forget the oldest document when over the limit."""
        document = tuple(tokens)
        if not document:
            return
        self._update(document, +1)
        self._documents.append(document)
        while len(self._documents) > self.max_documents:
            self._update(self._documents.popleft(), -1)

    def _update(self, document: tuple[int, ...], delta: int) -> None:
        depth = self.max_depth
        for start in range(len(document)):
            node = self._root
            for token in document[start : start + depth]:
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = _Node()
                child.count += delta
                if child.count == 0:  # removal: nothing below a zero-count node is still counted
                    del node.children[token]
                    break
                node = child

    def _match(self, context: Sequence[int], k: int) -> _Node | None:
        """The node of the longest suffix of `context` in the tree, no longer than max_depth - k tokens."""
        longest = min(len(context), self.max_depth - k)
        for length in range(longest, self.min_match - 1, -1):
            node = self._root
            for token in context[len(context) - length :]:
                node = node.children.get(token)
                if node is None:
                    break
            else:
                if node.children:
                    return node
        return None

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        """Up to `k` drafts continuing `context` (the request's tokens so far), most frequent branch first."""
        if k <= 0:
            return []
        node = self._match(context, k)
        drafts: list[int] = []
        while node is not None and node.children and len(drafts) < k:
            token, child = max(node.children.items(), key=lambda item: item[1].count)
            if child.count < self.min_count_fraction * node.count:
                break
            drafts.append(token)
            node = child
        return drafts
