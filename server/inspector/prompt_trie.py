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

from array import array
from collections.abc import Iterator, Sequence
from typing import Any

from engine.block_hashing import BlockHash, BlockHasher, block_extra, hash_block

_TOKEN = "i"  # token ids as 32-bit ints: 4 bytes each


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
    def __init__(self, hasher: BlockHasher) -> None:
        self.block_size = hasher.block_size
        self.model_id = hasher.model_id
        self.roots: dict[str | None, TrieNode] = {}
        self.by_hash: dict[BlockHash, TrieNode] = {}

    def _keys(self, tokens: Sequence[int]) -> Iterator[bytes]:
        bs = self.block_size
        for i in range(len(tokens) // bs):
            yield array(_TOKEN, tokens[i * bs : (i + 1) * bs]).tobytes()

    def insert(self, salt: str | None, tokens: Sequence[int], owner: Any) -> TrieNode:
        """Add a sequence's full blocks; returns the node of its last full block (the root if none), which the
        caller holds a reference on until it calls `release`."""
        node = self.roots.get(salt)
        if node is None:
            node = self.roots[salt] = TrieNode(None, b"", None)
        for key in self._keys(tokens):
            children = node.children
            if children is None:
                children = node.children = {}
            child = children.get(key)
            if child is None:
                extra = block_extra(self.model_id, salt) if node.parent is None else b""
                block_hash = hash_block(node.block_hash, array(_TOKEN, key).tolist(), extra)
                child = children[key] = TrieNode(node, key, block_hash)
                self.by_hash[block_hash] = child
                node.refs += 1
            child.owner = owner
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

    def match(self, salt: str | None, tokens: Sequence[int], max_blocks: int) -> tuple[int, TrieNode | None]:
        """How many leading full blocks of ``tokens`` (at most ``max_blocks``) the trie holds under ``salt``, and the
        deepest of those nodes."""
        node = self.roots.get(salt)
        matched, deepest = 0, None
        if node is None:
            return 0, None
        for key in self._keys(tokens[: max_blocks * self.block_size]):
            node = node.children.get(key) if node.children else None
            if node is None:
                break
            matched, deepest = matched + 1, node
        return matched, deepest

    def best_match_any_salt(self, tokens: Sequence[int], max_blocks: int) -> int:
        """The longest match under any salt (what a cache that ignored salts would have served)."""
        return max((self.match(salt, tokens, max_blocks)[0] for salt in self.roots), default=0)

    @staticmethod
    def tokens(node: TrieNode, tail: bytes = b"") -> list[int]:
        """The sequence ending at ``node``, then ``tail`` (a partial last block, as array bytes)."""
        out = array(_TOKEN, b"".join(n.key for n in node.path()) + tail)
        return out.tolist()

    @staticmethod
    def pack(tokens: Sequence[int]) -> bytes:
        return array(_TOKEN, tokens).tobytes()

    def memory_bytes(self) -> int:
        """An estimate of what the trie holds (node objects, their token and hash bytes, the children dicts)."""
        import sys

        total = sys.getsizeof(self.by_hash)
        for node in self.by_hash.values():
            total += sys.getsizeof(node) + sys.getsizeof(node.key) + sys.getsizeof(node.block_hash)
            if node.children is not None:
                total += sys.getsizeof(node.children)
        return total
