"""KV page bookkeeping: a pool of pages and a radix tree of cached full blocks, keyed by chained block hashes.

The manager knows page ids and token ids only; the tensors live in the model runner. Every page is exactly one of:
  free        -- in the free pool;
  cached      -- a node of the prefix tree that no live sequence holds (reference count 0): reusable, evictable;
  referenced  -- held by at least one live sequence, as a tree node (shared) or as a private page (its partial
                 last block, or a block that could not be cached).
A sequence's block table is its tree nodes (always a prefix of the table: block i's parent is block i-1) followed
by its private pages.
"""
from __future__ import annotations

import heapq
import itertools
from array import array
from dataclasses import dataclass, field
from hashlib import blake2b
from typing import Hashable, Sequence

BlockHash = bytes  # 16 bytes: 128 bits make an accidental collision practically impossible; tokens are checked anyway


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra: bytes = b"") -> BlockHash:
    """Chained hash of one full block: depends on every token before it, and on ``extra`` (only used for block 0)."""
    h = blake2b(digest_size=16)
    h.update(parent if parent is not None else b"root")
    h.update(len(extra).to_bytes(4, "little"))
    h.update(extra)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def block_extra(model_id: str, cache_salt: str | None) -> bytes:
    """What block 0 mixes in: the model identity and the tenant's salt, so neither ever shares pages across."""
    return f"{model_id}\0{cache_salt or ''}".encode()


@dataclass(eq=False)
class CachedBlock:
    """A radix-tree node: one full block whose K/V sit in ``page``."""

    block_hash: BlockHash
    page: int
    token_ids: tuple[int, ...]
    parent: "CachedBlock | None"
    children: dict[BlockHash, "CachedBlock"] = field(default_factory=dict)
    ref_count: int = 0
    last_used: int = 0
    created: int = 0


@dataclass
class SequenceBlocks:
    """One live sequence's pages: ``nodes`` (shared, in the tree) then ``private`` pages."""

    extra: bytes
    nodes: list[CachedBlock] = field(default_factory=list)
    private: list[int] = field(default_factory=list)
    hashes: list[BlockHash] = field(default_factory=list)  # hashes of its full blocks computed so far
    cacheable: bool = True  # false after a hash collision: later blocks stay private

    @property
    def block_table(self) -> list[int]:
        return [node.page for node in self.nodes] + self.private


@dataclass
class CacheStats:
    queries: int = 0  # prompt tokens looked up at admission
    hits: int = 0  # of those, tokens served from cached pages
    evictions: int = 0  # pages evicted from the tree


class KVCacheManager:
    """Allocates pages to sequences and shares full blocks between them through the prefix tree."""

    EVICTION_POLICIES = ("lru", "fifo")  # among unreferenced leaves: least recently used, or oldest cached first

    def __init__(
        self,
        num_pages: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        model_id: str = "",
        eviction_policy: str = "lru",
    ) -> None:
        if eviction_policy not in self.EVICTION_POLICIES:
            raise ValueError(f"eviction_policy must be one of {self.EVICTION_POLICIES}, got {eviction_policy!r}")
        self.eviction_policy = eviction_policy
        self.num_pages = num_pages
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.model_id = model_id
        self.free_pages: list[int] = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
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
    def num_free_pages(self) -> int:
        """Pages an allocation can get: free ones plus cached ones nobody holds."""
        return len(self.free_pages) + self._num_unreferenced

    @property
    def num_cached_pages(self) -> int:
        return len(self.by_hash)

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, seq_id: Hashable) -> list[int]:
        return self.seqs[seq_id].block_table

    def match_prefix(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[CachedBlock]:
        """The cached blocks of the longest cached prefix, leaving at least one token to compute."""
        if not self.enable_prefix_caching:
            return []
        extra = block_extra(self.model_id, cache_salt)
        matched: list[CachedBlock] = []
        children, parent_hash = self.roots, None
        bs = self.block_size
        for i in range((len(token_ids) - 1) // bs):
            block = token_ids[i * bs : (i + 1) * bs]
            block_hash = hash_block(parent_hash, block, extra if i == 0 else b"")
            node = children.get(block_hash)
            if node is None or node.token_ids != tuple(block):  # miss, or a hash collision caught by the token check
                break
            matched.append(node)
            children, parent_hash = node.children, block_hash
        return matched

    def num_cached_tokens(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """How many tokens admission would take from the cache now (no side effects)."""
        return len(self.match_prefix(token_ids, cache_salt)) * self.block_size

    # ---- sequence lifecycle ----------------------------------------------------------------------------------
    def admit(
        self, seq_id: Hashable, token_ids: Sequence[int], max_new_tokens: int, cache_salt: str | None = None
    ) -> int | None:
        """Start ``seq_id``: take its cached prefix, and pages for up to ``max_new_tokens`` tokens after it.

        Returns the number of cached tokens, or None (and changes nothing) when the pages are not there.
        """
        assert seq_id not in self.seqs, f"sequence {seq_id!r} is already admitted"
        matched = self.match_prefix(token_ids, cache_salt)
        seq = SequenceBlocks(extra=block_extra(self.model_id, cache_salt))
        for node in matched:
            self._ref(node)
        seq.nodes = matched
        seq.hashes = [node.block_hash for node in matched]
        self.seqs[seq_id] = seq
        num_cached = len(matched) * self.block_size
        if not self.allocate(seq_id, num_cached + min(len(token_ids) - num_cached, max_new_tokens)):
            self.free(seq_id)
            return None
        self.stats.queries += len(token_ids)
        self.stats.hits += num_cached
        return num_cached

    def allocate(self, seq_id: Hashable, num_tokens: int) -> bool:
        """Make the sequence's pages cover ``num_tokens`` tokens. False (and nothing changed) if they are not there."""
        seq = self.seqs[seq_id]
        missing = self.pages_needed(num_tokens) - len(seq.nodes) - len(seq.private)
        if missing <= 0:
            return True
        if missing > self.num_free_pages:
            return False
        seq.private.extend(self._take_page() for _ in range(missing))
        return True

    def commit(self, seq_id: Hashable, token_ids: Sequence[int], num_computed: int) -> None:
        """Record that the first ``num_computed`` tokens' K/V are in the pages: cache the blocks that are now full."""
        seq = self.seqs[seq_id]
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        while seq.cacheable and len(seq.nodes) < num_computed // bs:
            i = len(seq.nodes)
            block = tuple(token_ids[i * bs : (i + 1) * bs])
            parent = seq.nodes[-1] if seq.nodes else None
            block_hash = hash_block(parent.block_hash if parent else None, block, b"" if i else seq.extra)
            siblings = parent.children if parent else self.roots
            page = seq.private.pop(0)
            node = siblings.get(block_hash)
            if node is None:
                node = CachedBlock(block_hash, page, block, parent)
                siblings[block_hash] = node
                self.by_hash[block_hash] = node
                node.ref_count = 1
                node.last_used = node.created = next(self._clock)
            elif node.token_ids == block:
                # Another sequence cached the same block first: share its page, return ours to the pool.
                self._ref(node)
                self.free_pages.append(page)
            else:  # a real hash collision: keep this block (and everything after it) private
                seq.private.insert(0, page)
                seq.cacheable = False
                break
            seq.nodes.append(node)
            seq.hashes.append(block_hash)

    def fork(self, src_id: Hashable, dst_id: Hashable) -> list[tuple[int, int]] | None:
        """Start ``dst_id`` as a copy of ``src_id``: shared blocks are shared, private pages copied.

        Returns the (src_page, dst_page) copies the caller must make in the K/V tensors, or None if out of pages.
        """
        src = self.seqs[src_id]
        if len(src.private) > self.num_free_pages:
            return None
        for node in src.nodes:
            self._ref(node)
        dst = SequenceBlocks(extra=src.extra, nodes=list(src.nodes), hashes=list(src.hashes), cacheable=src.cacheable)
        dst.private = [self._take_page() for _ in src.private]
        self.seqs[dst_id] = dst
        return list(zip(src.private, dst.private))

    def free(self, seq_id: Hashable) -> None:
        """Release a finished, aborted or preempted sequence. Its cached blocks stay in the tree for later hits."""
        seq = self.seqs.pop(seq_id)
        self.free_pages.extend(reversed(seq.private))
        for node in reversed(seq.nodes):  # leaf first, so a parent is never older than its child in LRU order
            self._unref(node)

    def evict(self, num_pages: int) -> int:
        """Evict up to ``num_pages`` unreferenced cached pages (least recently used leaves first); returns the count."""
        count = 0
        while count < num_pages and self._num_unreferenced:
            self.free_pages.append(self._evict_one())
            count += 1
        return count

    def reset_prefix_cache(self) -> None:
        """Drop every unreferenced cached block (e.g. between benchmark runs)."""
        self.evict(self._num_unreferenced)

    # ---- internals -------------------------------------------------------------------------------------------
    def _take_page(self) -> int:
        if not self.free_pages:
            self.free_pages.append(self._evict_one())
        return self.free_pages.pop()

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
        return node.last_used if self.eviction_policy == "lru" else node.created

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
        return node.page

    # ---- invariants (tests and debugging) --------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Assert the page-state partition, reference counts and tree links. O(pages); for tests."""
        free = set(self.free_pages)
        assert len(free) == len(self.free_pages), "a page is in the free pool twice"
        holders: dict[int, int] = {}
        private: set[int] = set()
        for seq in self.seqs.values():
            for i, node in enumerate(seq.nodes):
                assert self.by_hash.get(node.block_hash) is node, "a sequence holds a node that left the tree"
                assert node.parent is (seq.nodes[i - 1] if i else None), "block table is not a path in the tree"
                holders[node.page] = holders.get(node.page, 0) + 1
            for page in seq.private:
                assert page not in private, f"private page {page} is held twice"
                private.add(page)
        tree_pages = set()
        unreferenced = 0
        for block_hash, node in self.by_hash.items():
            assert node.block_hash == block_hash
            siblings = node.parent.children if node.parent else self.roots
            assert siblings.get(block_hash) is node, "parent link does not match the tree"
            if node.parent is not None:
                assert self.by_hash.get(node.parent.block_hash) is node.parent
            assert node.ref_count == holders.get(node.page, 0), f"page {node.page}: ref_count != live holders"
            assert node.page not in tree_pages
            tree_pages.add(node.page)
            unreferenced += node.ref_count == 0
            if node.ref_count:
                assert node.parent is None or node.parent.ref_count > 0, "a held block's parent is unreferenced"
        assert unreferenced == self._num_unreferenced
        assert not (free & tree_pages) and not (free & private) and not (tree_pages & private)
        assert len(free) + len(tree_pages) + len(private) == self.num_pages, "a page is lost"
