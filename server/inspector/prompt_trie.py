"""The inspector's token store: every recorded sequence (prompt and reply) as a path of full blocks in a trie, one
root per cache salt, so a prefix that many requests share (an agent's system prompt and tools, a conversation's
earlier turns) is stored once.

Nodes are the engine's blocks: the same block size, keyed by their tokens, and each carries the engine's chained
block hash (computed once, when the node is created), so an engine block can be traced back to the requests that
produced it. A node lives while some record ends at or below it (reference counts), and remembers the newest record
whose sequence passed through it (its `owner`: the last request that could have left it in the cache).

Matching a new prompt against the trie gives what an unbounded prefix cache would have served over the recorded
window (the inspector's "ideal").
"""
from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from engine.kv.block_hashing import BlockHash, BlockHasher, block_extra, hash_block

_TOKEN = "i"  # token ids as 32-bit ints
_ITEM = array(_TOKEN).itemsize


class TrieNode:
    __slots__ = ("parent", "key", "block_hash", "children", "refs", "owner")

    def __init__(self, parent: TrieNode | None, key: bytes, block_hash: BlockHash | None) -> None:
        self.parent = parent
        self.key = key  # the block's tokens (array bytes); b"" for a root
        self.block_hash = block_hash  # the engine's hash of this block (None for a root)
        self.children: dict[bytes, TrieNode] | None = None
        self.refs = 0  # records ending here + children
        self.owner: Any = None  # the newest record whose sequence passes through this node

    def path(self) -> list[TrieNode]:
        """The blocks from the root's first child down to this node."""
        nodes = []
        node: TrieNode | None = self
        while node is not None and node.parent is not None:
            nodes.append(node)
            node = node.parent
        nodes.reverse()
        return nodes


class PromptTrie:
    """Sequences go in and come out packed (`pack`: 4 bytes a token), so a block's key is a slice of the bytes."""

    def __init__(self, hasher: BlockHasher) -> None:
        self.block_size = hasher.block_size
        self.model_id = hasher.model_id
        self.roots: dict[str | None, TrieNode] = {}
        self.by_hash: dict[BlockHash, TrieNode] = {}
        self._key_bytes = self.block_size * _ITEM

    def _keys(self, packed: bytes, max_blocks: int | None = None) -> Iterator[bytes]:
        width = self._key_bytes
        blocks = len(packed) // width if max_blocks is None else min(max_blocks, len(packed) // width)
        return (packed[i * width : (i + 1) * width] for i in range(blocks))

    def known_path(self, salt: str | None, packed: bytes) -> list[TrieNode]:
        """The nodes the trie already holds of a packed sequence's leading full blocks, root's child first."""
        path: list[TrieNode] = []
        node = self.roots.get(salt)
        if node is None:
            return path
        for key in self._keys(packed):
            node = node.children.get(key) if node.children else None
            if node is None:
                break
            path.append(node)
        return path

    def insert(self, salt: str | None, packed: bytes, known: list[TrieNode], owner: Any) -> TrieNode:
        """Add a sequence's full blocks past ``known`` (its `known_path`, taken just before); ``owner`` becomes the
        newest owner of all of them. Returns the node of its last full block (the root if none), which the caller
        holds a reference on until it calls `release`."""
        for node in known:
            node.owner = owner
        node = known[-1] if known else self.roots.get(salt)
        if node is None:
            node = self.roots[salt] = TrieNode(None, b"", None)
        for key in self._keys(packed[len(known) * self._key_bytes :]):
            extra = block_extra(self.model_id, salt) if node.parent is None else b""
            block_hash = hash_block(node.block_hash, unpack(key), extra)
            child = TrieNode(node, key, block_hash)
            if node.children is None:
                node.children = {}
            node.children[key] = child
            self.by_hash[block_hash] = child
            child.owner = owner
            node.refs += 1
            node = child
        node.refs += 1
        return node

    def release(self, node: TrieNode, salt: str | None) -> None:
        """Drop a record's reference; nodes nothing needs any more leave the trie."""
        node.refs -= 1
        while node.refs == 0:
            parent = node.parent
            if parent is None:
                del self.roots[salt]
                return
            del parent.children[node.key]
            if not parent.children:
                parent.children = None
            del self.by_hash[node.block_hash]
            node = parent
            node.refs -= 1

    def match(self, salt: str | None, packed: bytes, max_blocks: int) -> tuple[int, TrieNode | None]:
        """How many leading full blocks of a packed sequence (at most ``max_blocks``) the trie holds under
        ``salt``, and the deepest of those nodes."""
        node = self.roots.get(salt)
        matched, deepest = 0, None
        if node is None:
            return 0, None
        for key in self._keys(packed, max_blocks):
            node = node.children.get(key) if node.children else None
            if node is None:
                break
            matched, deepest = matched + 1, node
        return matched, deepest

    def best_match_other_salts(self, salt: str | None, packed: bytes, max_blocks: int,
                               among: Iterable[str | None] | None = None) -> int:
        """The longest match under any salt but ``salt`` (what a cache that ignored salts would have served
        beyond the salt's own); ``among``: only those salts (the inspector passes the tenant's own)."""
        others = self.roots if among is None else [other for other in among if other in self.roots]
        return max((self.match(other, packed, max_blocks)[0] for other in others if other != salt), default=0)

    def tail(self, packed: bytes) -> bytes:
        """What follows the last full block of a packed sequence (`insert` stores the full blocks)."""
        return packed[len(packed) - len(packed) % self._key_bytes :]

    @staticmethod
    def sequence(node: TrieNode, tail: bytes = b"") -> bytes:
        """The packed sequence ending at ``node``, then ``tail`` (a partial last block)."""
        return b"".join(n.key for n in node.path()) + tail

    def memory_bytes(self) -> int:
        """An estimate of what the trie holds (node objects, their token and hash bytes, the children dicts)."""
        total = sys.getsizeof(self.by_hash)
        for node in self.by_hash.values():
            total += sys.getsizeof(node) + sys.getsizeof(node.key) + sys.getsizeof(node.block_hash)
            if node.children is not None:
                total += sys.getsizeof(node.children)
        return total


def pack(tokens: Sequence[int]) -> bytes:
    return array(_TOKEN, tokens).tobytes()


def unpack(packed: bytes, start: int = 0, end: int | None = None) -> list[int]:
    """The token ids of a packed sequence (from token ``start`` to ``end``)."""
    return array(_TOKEN, packed[start * _ITEM : None if end is None else end * _ITEM]).tolist()


def num_tokens(packed: bytes) -> int:
    return len(packed) // _ITEM


def common_prefix_packed(a: bytes, b: bytes) -> int:
    """How many tokens two packed sequences share at their start: a binary search over comparisons done in C."""
    lo, hi = 0, min(len(a), len(b)) // _ITEM
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[: mid * _ITEM] == b[: mid * _ITEM]:
            lo = mid
        else:
            hi = mid - 1
    return lo
