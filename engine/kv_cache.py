"""KV block bookkeeping: a pool of blocks and a radix tree of cached full blocks, keyed by chained block hashes.

The manager knows block ids, hashes and token ids only; the tensors live in the model runner, and the scheduler is
its only caller. Every block of the pool is exactly one of:
  free        -- in the free list;
  cached      -- a node of the prefix tree that no live sequence holds (reference count 0): reusable, evictable;
  referenced  -- held by at least one live sequence, as a tree node (shared) or as a private block (its partial
                 last block, a block that could not be cached, or a duplicate of a block another sequence cached
                 first).
A sequence's block table only ever grows (the runner mirrors it with append-only deltas). Its tree path
(``nodes``, one per full block, each the child of the previous) is held alongside: block i of the table is
``nodes[i].block_id`` unless the sequence computed that block privately before anyone cached it.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Hashable, Sequence

from engine.block_hashing import BlockHash
from engine.config import EvictionPolicy


@dataclass(eq=False)
class CachedBlock:
    """A radix-tree node: one full block whose K/V sit in block ``block_id`` of the pool."""

    block_hash: BlockHash
    block_id: int
    token_ids: tuple[int, ...]
    parent: "CachedBlock | None"
    children: dict[BlockHash, "CachedBlock"] = field(default_factory=dict)
    ref_count: int = 0
    last_used: int = 0
    created: int = 0


@dataclass
class SequenceBlocks:
    """One live sequence's blocks: its block table and the tree path it holds references on."""

    block_ids: list[int] = field(default_factory=list)
    nodes: list[CachedBlock] = field(default_factory=list)
    cacheable: bool = True  # false after a hash collision: later blocks stay private

    def private_block_ids(self) -> list[int]:
        nodes = self.nodes
        return [b for i, b in enumerate(self.block_ids) if i >= len(nodes) or nodes[i].block_id != b]


@dataclass
class CacheStats:
    queries: int = 0  # prompt tokens looked up at first admission
    hits: int = 0  # of those, tokens served from cached blocks
    preempted_queries: int = 0  # tokens looked up when a preempted sequence was re-admitted (counted apart)
    preempted_hits: int = 0
    evictions: int = 0  # cached blocks evicted from the tree

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    """Allocates blocks to sequences and shares full blocks between them through the prefix tree."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        eviction_policy: EvictionPolicy | str = EvictionPolicy.LRU,
    ) -> None:
        self.eviction_policy = EvictionPolicy(eviction_policy)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.free_block_ids: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self.roots: dict[BlockHash, CachedBlock] = {}
        self.by_hash: dict[BlockHash, CachedBlock] = {}
        self.seqs: dict[Hashable, SequenceBlocks] = {}
        self.stats = CacheStats()
        self._num_unreferenced = 0  # tree nodes with ref_count 0: all of them can be evicted, leaves first
        self._evict_heap: list[tuple[int, int, CachedBlock]] = []  # (priority, tiebreak, node), lazily validated
        self._clock = itertools.count(1)
        self._tiebreak = itertools.count()

    # ---- queries -------------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can get: free ones plus cached ones nobody holds."""
        return len(self.free_block_ids) + self._num_unreferenced

    @property
    def num_cached_blocks(self) -> int:
        return len(self.by_hash)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, seq_id: Hashable) -> list[int]:
        return self.seqs[seq_id].block_ids

    def _shareable_blocks(self, block_hashes: Sequence[BlockHash], num_tokens: int) -> int:
        """Blocks of a prefix that admission may take from the cache: full ones, leaving at least one token."""
        if not self.enable_prefix_caching:
            return 0
        return min(len(block_hashes), (num_tokens - 1) // self.block_size)

    def num_cached_blocks_of(self, block_hashes: Sequence[BlockHash], num_tokens: int) -> int:
        """How many leading blocks of a sequence the tree holds now (no side effects; O(log blocks)).

        The cached blocks of any hash chain form a prefix of it (blocks enter parent first and leave leaf first),
        so a binary search over the chain finds the match length."""
        lo, hi = 0, self._shareable_blocks(block_hashes, num_tokens)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if block_hashes[mid - 1] in self.by_hash:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def num_cached_tokens(self, block_hashes: Sequence[BlockHash], num_tokens: int) -> int:
        """How many tokens admission would take from the cache now."""
        return self.num_cached_blocks_of(block_hashes, num_tokens) * self.block_size

    def _match(self, block_hashes: Sequence[BlockHash], token_ids: Sequence[int]) -> list[CachedBlock]:
        """The cached blocks of the longest cached prefix, checking their tokens (collision guard)."""
        bs = self.block_size
        matched: list[CachedBlock] = []
        for i in range(self.num_cached_blocks_of(block_hashes, len(token_ids))):
            node = self.by_hash[block_hashes[i]]
            if node.token_ids != tuple(token_ids[i * bs : (i + 1) * bs]):
                break
            matched.append(node)
        return matched

    # ---- sequence lifecycle ----------------------------------------------------------------------------------
    def admit(
        self,
        seq_id: Hashable,
        block_hashes: Sequence[BlockHash],
        token_ids: Sequence[int],
        max_new_tokens: int,
        resumed: bool = False,
    ) -> int | None:
        """Start ``seq_id``: take its cached prefix, and blocks for up to ``max_new_tokens`` tokens after it.

        Returns the number of cached tokens, or None (and changes nothing) when the blocks are not there.
        ``resumed`` marks a preempted sequence coming back: its lookup is counted apart from first admissions.
        """
        assert seq_id not in self.seqs, f"sequence {seq_id!r} is already admitted"
        matched = self._match(block_hashes, token_ids)
        num_cached = len(matched) * self.block_size
        need = self.blocks_needed(num_cached + min(len(token_ids) - num_cached, max_new_tokens)) - len(matched)
        unreferenced_matched = sum(node.ref_count == 0 for node in matched)
        if need > self.num_free_blocks - unreferenced_matched:  # matched blocks stop being evictable once held
            return None
        for node in matched:
            self._ref(node)
        self.seqs[seq_id] = SequenceBlocks([node.block_id for node in matched], matched)
        self.allocate(seq_id, num_cached + min(len(token_ids) - num_cached, max_new_tokens))
        if resumed:
            self.stats.preempted_queries += len(token_ids)
            self.stats.preempted_hits += num_cached
        else:
            self.stats.queries += len(token_ids)
            self.stats.hits += num_cached
        return num_cached

    def allocate(self, seq_id: Hashable, num_tokens: int) -> list[int] | None:
        """Make the sequence's blocks cover ``num_tokens`` tokens; returns the block ids appended to its table, or
        None (and nothing changed) if they are not there."""
        seq = self.seqs[seq_id]
        missing = self.blocks_needed(num_tokens) - len(seq.block_ids)
        if missing <= 0:
            return []
        if missing > self.num_free_blocks:
            return None
        new = [self._take_block() for _ in range(missing)]
        seq.block_ids.extend(new)
        return new

    def commit(
        self, seq_id: Hashable, block_hashes: Sequence[BlockHash], token_ids: Sequence[int], num_tokens: int
    ) -> None:
        """Record that the first ``num_tokens`` tokens' K/V are (or, by the end of the step, will be) in the blocks:
        cache the blocks that are full."""
        seq = self.seqs[seq_id]
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        while seq.cacheable and len(seq.nodes) < min(num_tokens // bs, len(block_hashes)):
            i = len(seq.nodes)
            block_hash = block_hashes[i]
            block = tuple(token_ids[i * bs : (i + 1) * bs])
            parent = seq.nodes[-1] if seq.nodes else None
            siblings = parent.children if parent else self.roots
            node = siblings.get(block_hash)
            if node is None:
                node = CachedBlock(block_hash, seq.block_ids[i], block, parent)
                siblings[block_hash] = node
                self.by_hash[block_hash] = node
                node.ref_count = 1
                node.last_used = node.created = next(self._clock)
            elif node.token_ids == block:
                # Another sequence cached the same block first: hold its node (so the path stays whole) but keep
                # computing into our own block, which stays private until we finish: tables never change.
                self._ref(node)
            else:  # a real hash collision: keep this block (and everything after it) private
                seq.cacheable = False
                break
            seq.nodes.append(node)

    def free(self, seq_id: Hashable) -> None:
        """Release a finished, aborted or preempted sequence. Its cached blocks stay in the tree for later hits."""
        seq = self.seqs.pop(seq_id)
        self.free_block_ids.extend(reversed(seq.private_block_ids()))
        for node in reversed(seq.nodes):  # leaf first, so a parent is never older than its child in LRU order
            self._unref(node)

    def evict(self, num_blocks: int) -> int:
        """Evict up to ``num_blocks`` unreferenced cached blocks (least recently used leaves first); returns the
        count."""
        count = 0
        while count < num_blocks and self._num_unreferenced:
            self.free_block_ids.append(self._evict_one())
            count += 1
        return count

    def reset_prefix_cache(self) -> None:
        """Drop every unreferenced cached block (e.g. between benchmark runs)."""
        self.evict(self._num_unreferenced)

    # ---- internals -------------------------------------------------------------------------------------------
    def _take_block(self) -> int:
        if not self.free_block_ids:
            self.free_block_ids.append(self._evict_one())
        return self.free_block_ids.pop()

    def _ref(self, node: CachedBlock) -> None:
        if node.ref_count == 0:
            self._num_unreferenced -= 1
        node.ref_count += 1
        node.last_used = next(self._clock)

    def _unref(self, node: CachedBlock) -> None:
        node.ref_count -= 1
        assert node.ref_count >= 0
        if node.ref_count == 0:
            self._num_unreferenced += 1
            node.last_used = next(self._clock)
            if not node.children:
                self._push_evictable(node)

    def _priority(self, node: CachedBlock) -> int:
        return node.last_used if self.eviction_policy is EvictionPolicy.LRU else node.created

    def _push_evictable(self, node: CachedBlock) -> None:
        heapq.heappush(self._evict_heap, (self._priority(node), next(self._tiebreak), node))

    def _evict_one(self) -> int:
        while True:
            priority, _, node = heapq.heappop(self._evict_heap)
            stale = (
                node.ref_count
                or node.children
                or priority != self._priority(node)
                or self.by_hash.get(node.block_hash) is not node
            )
            if not stale:
                break
        siblings = node.parent.children if node.parent else self.roots
        del siblings[node.block_hash]
        del self.by_hash[node.block_hash]
        self._num_unreferenced -= 1
        self.stats.evictions += 1
        if node.parent is not None and node.parent.ref_count == 0 and not node.parent.children:
            self._push_evictable(node.parent)
        return node.block_id

    # ---- invariants (tests and debugging) --------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Assert the block-state partition, reference counts and tree links. O(blocks); for tests."""
        free = set(self.free_block_ids)
        assert len(free) == len(self.free_block_ids), "a block is in the free list twice"
        holders: dict[int, int] = {}
        private: set[int] = set()
        for seq in self.seqs.values():
            assert len(seq.nodes) <= len(seq.block_ids)
            for i, node in enumerate(seq.nodes):
                assert self.by_hash.get(node.block_hash) is node, "a sequence holds a node that left the tree"
                assert node.parent is (seq.nodes[i - 1] if i else None), "the held nodes are not a path in the tree"
                holders[id(node)] = holders.get(id(node), 0) + 1
            for block_id in seq.private_block_ids():
                assert block_id not in private, f"private block {block_id} is held twice"
                private.add(block_id)
        tree_blocks = set()
        unreferenced = 0
        for block_hash, node in self.by_hash.items():
            assert node.block_hash == block_hash
            siblings = node.parent.children if node.parent else self.roots
            assert siblings.get(block_hash) is node, "parent link does not match the tree"
            if node.parent is not None:
                assert self.by_hash.get(node.parent.block_hash) is node.parent
            assert node.ref_count == holders.get(id(node), 0), f"block {node.block_id}: ref_count != live holders"
            assert node.block_id not in tree_blocks
            tree_blocks.add(node.block_id)
            unreferenced += node.ref_count == 0
            if node.ref_count:
                assert node.parent is None or node.parent.ref_count > 0, "a held block's parent is unreferenced"
        assert unreferenced == self._num_unreferenced
        assert not (free & tree_blocks) and not (free & private) and not (tree_blocks & private)
        assert len(free) + len(tree_blocks) + len(private) == self.num_blocks, "a block is lost"
