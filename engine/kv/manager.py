"""KV block bookkeeping: a pool of blocks and a radix tree of cached full blocks, keyed by chained block hashes,
with retention classes in the eviction order and tiers below the device pool.

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

Eviction (`engine.kv.eviction`) takes ordinary unreferenced leaves first, blocks retained by a pin or a session
hold last. With lower tiers (`engine.kv.tiers`), an evicted block is offloaded to the host pool instead of lost, and
admission continues a device match in the host and disk tiers: those blocks are restored into fresh device blocks
(copy instructions for the runner), counted as cached. Every change to what a tier holds is recorded as a KV event.

Hybrid models (``state_rows`` > 0) add a second cache group, the recurrent-state rows of `engine.kv.state_pool`:
a running sequence holds one, and a node may own a *snapshot* (the state at its block's end). A prefix is
resumable only where every group can resume it, so a hit ends at the deepest matched block with a snapshot;
admission copies that snapshot into the sequence's slot (`StateCopy`, before the step's forward). Where snapshots
are taken is the scheduler's policy (`engine.kv.snapshot_policy`); `take_snapshot` records one (a copy after the
step's forward) and attaches it to its block once the block is in the tree. With lower tiers, a snapshot leaving
the device (its block evicted, or its slot needed) goes to the host pool with its block, under the block's hash,
and on to disk; a hit may then end at a block whose snapshot a lower tier holds (restored into the sequence's slot
by a transfer), and its KV events say which blocks carry snapshots in each medium.
"""
from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Collection
from dataclasses import replace
from typing import Hashable, Iterable, Protocol, Sequence

from engine.kv.block_hashing import BlockHash
from engine.config import EvictionPolicy
from engine.kv.blocks import CachedBlock, CachedPrefix, CacheStats, KVCounters, SequenceBlocks
from engine.kv.events import MEDIUM_DEVICE, EventRecorder, KVEvent
from engine.kv.eviction import EvictionQueue
from engine.kv.state_pool import StatePool
from engine.kv.invariants import check_invariants
from engine.kv.window_cache import WindowCache
from engine.kv.window_pool import WindowPool
from engine.kv.tiers import FoundBlock, LowerTiers, TierBlock, TierIndex
from engine.outputs import KVTransfer, StateCopy
from engine.retention import Retention


class PrefixCacheView(Protocol):
    """What the rest of the engine may ask of the prefix cache between steps (the inspector's queries), read-only:
    the scheduler alone changes the KV state, through `KVCacheManager`'s other methods."""

    def num_cached_tokens(self, block_hashes: Sequence[BlockHash], num_tokens: int) -> int: ...

    def where_cached(self, block_hashes: Sequence[BlockHash]) -> list[str | None]: ...

    def snapshot_points(self, block_hashes: Sequence[BlockHash]) -> list[int]: ...

    def cached_prefixes(self, limit: int) -> list[CachedPrefix]: ...

    def clock(self) -> float: ...


class KVCacheManager(WindowCache):
    """Allocates blocks to sequences and shares full blocks between them through the prefix tree."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        eviction_policy: EvictionPolicy | str = EvictionPolicy.LRU,
        *,
        max_retained_fraction: float = 0.5,
        max_retained_share_per_tenant: float = 1.0,
        host_blocks: int = 0,
        disk_blocks: int = 0,
        record_events: bool = False,
        clock: Callable[[], float] = time.monotonic,
        state_rows: int = 0,
        weigh_snapshots: bool = True,
        host_states: int = 0,
        disk_states: int = 0,
        window_blocks: int = 0,
        window: int = 0,
    ) -> None:
        """``state_rows`` > 0: a hybrid model, whose recurrent layers keep a state per sequence in that many slots
        (`engine.kv.state_pool`); a cached prefix is then resumable only where its state is known. ``host_states``
        / ``disk_states``: the snapshots the lower tiers keep.
        ``weigh_snapshots``: when slots run short, a snapshot with a deeper one below it and no branch between
        them goes first, and a new snapshot never evicts one at a branch point (False: plain LRU, as the simulator
        models other engines). ``max_retained_share_per_tenant``: the fraction of the retention cap the blocks one
        tenant retains may take (`Retention.tenant`). ``window_blocks`` > 0: a sliding-window model whose window layers
        (``window`` tokens wide) keep their pages in a group of that many (`engine.kv.window_pool`, used through
        `engine.kv.window_cache`); a cached prefix is then resumable only where the pages of its window are
        still there."""
        assert not (state_rows and window_blocks), "a model with both recurrent and window layers is not supported"
        self.eviction_policy = EvictionPolicy(eviction_policy)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.clock = clock
        self.free_block_ids: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self.roots: dict[BlockHash, CachedBlock] = {}
        self.by_hash: dict[BlockHash, CachedBlock] = {}
        self.seqs: dict[Hashable, SequenceBlocks] = {}
        self.stats = CacheStats()
        # a hybrid's BlockStored events say which blocks carry a snapshot; a window model's, a retained window
        self.events = EventRecorder(record_events, snapshots=state_rows > 0 or window_blocks > 0)
        self.tiers = LowerTiers(host_blocks, disk_blocks, self.events, host_states, disk_states,
                                windows=window_blocks > 0)
        max_retained = int(max_retained_fraction * num_blocks)
        self.queue = EvictionQueue(self.eviction_policy, self._now, max_retained,
                                   int(max_retained_share_per_tenant * max_retained))
        self.states = StatePool(state_rows, on_evict=self._snapshot_evicted) if state_rows else None
        self.weigh_snapshots = weigh_snapshots
        self.window = (WindowPool(window_blocks, window, block_size, on_drop=self._anchor_evicted)
                       if window_blocks else None)
        self.window_deltas: dict[Hashable, list[int]] = {}  # window pages appended since the runner last heard
        self.state_restores: list[StateCopy] = []  # for the step being scheduled: before its forward ...
        self.state_snapshots: list[StateCopy] = []  # ... and after it
        self._admission_reads: set[BlockHash] = set()  # lower-tier blocks the admission under way will read
        self._num_unreferenced = 0  # tree nodes with ref_count 0: all of them can be evicted, leaves first
        self._counter = itertools.count(1)

    def _now(self) -> float:
        return self.clock()

    # ---- queries -------------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can get: free ones plus cached ones nobody holds."""
        return len(self.free_block_ids) + self._num_unreferenced

    @property
    def num_cached_blocks(self) -> int:
        return len(self.by_hash)

    @property
    def num_retained_blocks(self) -> int:
        self.queue.expire()
        return self.queue.num_retained

    @property
    def num_sequences(self) -> int:
        """Sequences holding blocks (0 once every request has ended: each block is free or cached)."""
        return len(self.seqs)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, seq_id: Hashable) -> list[int]:
        return self.seqs[seq_id].block_ids

    def state_row(self, seq_id: Hashable) -> int:
        """The recurrent-state row the sequence runs in (-1: not a hybrid model)."""
        return self.seqs[seq_id].state_row

    def num_held_blocks(self, seq_id: Hashable) -> int:
        """Blocks in the sequence's block table (cached or private)."""
        return len(self.seqs[seq_id].block_ids)

    def num_shared_blocks(self, seq_id: Hashable) -> int:
        """The leading blocks of the sequence that sit in the prefix tree (the rest are its own)."""
        return len(self.seqs[seq_id].nodes)

    def lower_tier_hits(self, seq_id: Hashable) -> tuple[int, int]:
        """Tokens of the sequence's cached prefix restored at admission from the host and from the disk tier."""
        blocks = self.seqs[seq_id]
        return blocks.host_hits, blocks.disk_hits

    def counters(self) -> KVCounters:
        """The pool's, the tiers' and the snapshots' sizes and counts, for the engine's stats."""
        host, disk, states = self.tiers.host, self.tiers.disk, self.states
        return KVCounters(
            cache=replace(self.stats), blocks_total=self.num_blocks, blocks_free=self.num_free_blocks,
            blocks_cached=self.num_cached_blocks, blocks_retained=self.num_retained_blocks,
            retention_refused_blocks=self.queue.refused,
            host_blocks_total=host.capacity if host is not None else 0,
            host_blocks_cached=len(host) if host is not None else 0,
            disk_blocks_total=disk.capacity if disk is not None else 0,
            disk_blocks_cached=len(disk) if disk is not None else 0,
            host_dropped_blocks=self.tiers.host_drops, disk_dropped_blocks=self.tiers.disk_drops,
            snapshots_cached=len(states.snapshots) if states is not None else 0,
            snapshot_evictions=states.evictions if states is not None else 0)

    def _shareable_blocks(self, block_hashes: Sequence[BlockHash], num_tokens: int) -> int:
        """Blocks of a prefix that admission may take from the cache: full ones, leaving at least one token."""
        if not self.enable_prefix_caching:
            return 0
        return min(len(block_hashes), (num_tokens - 1) // self.block_size)

    def _device_prefix(self, block_hashes: Sequence[BlockHash], num_tokens: int) -> int:
        """Leading blocks of the chain in the device tree, snapshots or not (no side effects; O(log blocks)): the
        cached blocks of any hash chain form a prefix of it (blocks enter parent first and leave leaf first), so a
        binary search over the chain finds the match length."""
        lo, hi = 0, self._shareable_blocks(block_hashes, num_tokens)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if block_hashes[mid - 1] in self.by_hash:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def num_cached_tokens(self, block_hashes: Sequence[BlockHash], num_tokens: int) -> int:
        """How many tokens admission would take from the cache now, lower tiers included."""
        device = self._device_prefix(block_hashes, num_tokens)
        lower = list(itertools.takewhile(lambda h: self.tiers.find(h) is not None,
                                         block_hashes[device : self._shareable_blocks(block_hashes, num_tokens)]))
        if self.states is None and self.window is None:
            return (device + len(lower)) * self.block_size
        nodes = [self.by_hash[h] for h in block_hashes[:device]]
        return self._resumable_end(nodes, lower, self._resumes_on_device(nodes)) * self.block_size

    def where_cached(self, block_hashes: Sequence[BlockHash]) -> list[str | None]:
        """Where each block of a chain is cached now: "retained" (on the device, pinned or held), "device", "host",
        "disk", or None."""
        self.queue.expire()
        out: list[str | None] = []
        for block_hash in block_hashes:
            node = self.by_hash.get(block_hash)
            if node is not None:
                out.append("retained" if node.retained else "device")
            else:
                found = self.tiers.find(block_hash)
                out.append(None if found is None else "host" if found[0] is self.tiers.host else "disk")
        return out

    def snapshot_points(self, block_hashes: Sequence[BlockHash]) -> list[int]:
        """Hybrid and sliding-window models: where a chain can resume now, as token counts (the ends of its device
        blocks that hold a recurrent-state snapshot or a retained window)."""
        return [(i + 1) * self.block_size for i, block_hash in enumerate(block_hashes)
                if (node := self.by_hash.get(block_hash)) is not None
                and (node.snapshot_row >= 0 or node.window_pages is not None)]

    def cached_prefixes(self, limit: int) -> list[CachedPrefix]:
        """The ``limit`` longest root-to-leaf paths of the device tree, longest first. O(cached blocks)."""
        self.queue.expire()
        depth: dict[BlockHash, int] = {}
        for block_hash, node in self.by_hash.items():  # a parent is always inserted before its children
            depth[block_hash] = depth[node.parent.block_hash] + 1 if node.parent is not None else 1
        leaves = [node for node in self.by_hash.values() if not node.children]
        out = []
        for leaf in heapq.nlargest(limit, leaves, key=lambda n: depth[n.block_hash]):
            path: list[CachedBlock] = []
            node: CachedBlock | None = leaf
            while node is not None:
                path.append(node)
                node = node.parent
            path.reverse()
            out.append(CachedPrefix(tuple(n.block_hash for n in path), sum(n.ref_count > 0 for n in path),
                                    sum(n.retained for n in path),
                                    max((n.retained_until for n in path if n.retained), default=0.0)))
        return out

    def _match(self, block_hashes: Sequence[BlockHash], token_ids: Sequence[int]) -> list[CachedBlock]:
        """The cached blocks of the longest cached prefix, checking their tokens (collision guard). A hybrid
        model's is cut where its state is known by `_resumable`."""
        bs = self.block_size
        matched: list[CachedBlock] = []
        for i in range(self._device_prefix(block_hashes, len(token_ids))):
            node = self.by_hash[block_hashes[i]]
            if node.token_ids != tuple(token_ids[i * bs : (i + 1) * bs]):
                break
            matched.append(node)
        return matched

    def _resumes_on_device(self, nodes: Sequence[CachedBlock]) -> Callable[[int], bool]:
        """Whether a hit can end after ``nodes[:i]`` with what the device holds: a usable snapshot there (hybrid
        models), or the pages of its window (sliding-window models: any ``i`` up to the deepest such end)."""
        if self.window is not None:
            deepest = len(self._window_hit(list(nodes)))
            return lambda i: i <= deepest
        return lambda i: i <= len(nodes) and self.states.usable(nodes[i - 1])

    def _resumable_end(self, nodes: Sequence[CachedBlock], lower: Sequence[BlockHash],
                       on_device: Callable[[int], bool]) -> int:
        """Blocks up to the deepest one a hit can resume at: on the device (``on_device``), or with the snapshot or
        window a lower tier holds (device blocks ``nodes``, then lower-tier blocks ``lower``)."""
        chain = [n.block_hash for n in nodes] + list(lower)
        for i in range(len(chain), 0, -1):
            if on_device(i) or self.tiers.find_state(chain[i - 1]):
                return i
        return 0

    def _resumable(self, matched: list[CachedBlock], lower: list[tuple[BlockHash, TierIndex, TierBlock]]
                   ) -> tuple[list[CachedBlock], list[tuple[BlockHash, TierIndex, TierBlock]], TierIndex | None]:
        """A hybrid or sliding-window model's hit: the device and lower-tier blocks up to the deepest one it can
        resume at, and the tier holding the snapshot or window there (None: the device's). A disk snapshot whose
        file fails its check is passed over."""
        chain = [n.block_hash for n in matched] + [h for h, _, _ in lower]
        on_device = self._resumes_on_device(matched)
        for i in range(len(chain), 0, -1):
            if on_device(i):
                return matched[:i], [], None
            tier = self.tiers.find_state(chain[i - 1])
            if tier is not None and self.tiers.usable(tier, chain[i - 1]) and tier.has_state(chain[i - 1]):
                return matched[:i], lower[: max(0, i - len(matched))], tier
        return [], [], None

    def _match_lower(self, block_hashes: Sequence[BlockHash], token_ids: Sequence[int],
                     start: int) -> list[tuple[BlockHash, TierIndex, TierBlock]]:
        """Where the device match ends, the blocks that continue it in the host and disk tiers."""
        bs = self.block_size
        found = []
        for i in range(start, self._shareable_blocks(block_hashes, len(token_ids)) if self.tiers.enabled else 0):
            block_hash = block_hashes[i]
            hit = self.tiers.find(block_hash)
            if hit is None or block_hash in self.by_hash or hit[1].token_ids != tuple(token_ids[i * bs:(i + 1) * bs]):
                break
            if not self.tiers.usable(hit[0], block_hash):  # an unreadable disk block: a miss from here on
                break
            found.append((block_hash, *hit))
        return found

    # ---- sequence lifecycle ----------------------------------------------------------------------------------
    def admit(
        self,
        seq_id: Hashable,
        block_hashes: Sequence[BlockHash],
        token_ids: Sequence[int],
        max_new_tokens: int,
        resumed: bool = False,
        retention: Retention | None = None,
        reserve_tokens: int = 0,
    ) -> int | None:
        """Start ``seq_id``: take its cached prefix (restoring what the lower tiers hold), and blocks for up to
        ``max_new_tokens`` tokens after it; apply its pins.

        Returns the number of cached tokens, or None (and changes nothing) when the blocks are not there (with room
        for ``reserve_tokens`` more tokens, not allocated: a simulator that does not model preemption).
        ``resumed`` marks a preempted sequence coming back: its lookup is counted apart from first admissions.
        """
        assert seq_id not in self.seqs, f"sequence {seq_id!r} is already admitted"
        matched = self._match(block_hashes, token_ids)
        lower = self._match_lower(block_hashes, token_ids, len(matched))
        source, source_tier = -1, None
        if self.states is not None or self.window is not None:
            matched, lower, source_tier = self._resumable(matched, lower)
            if self.states is not None and matched and source_tier is None:
                source = matched[-1].snapshot_row
        num_cached = (len(matched) + len(lower)) * self.block_size
        need = self.blocks_needed(num_cached + min(len(token_ids) - num_cached, max_new_tokens) + reserve_tokens)
        # Matched blocks stop being evictable once held: they are not free for the rest.
        unreferenced_matched = sum(node.ref_count == 0 for node in matched)
        if need - len(matched) > self.num_free_blocks - unreferenced_matched:
            return None
        if self.states is not None and not self.states.num_available(keep=source):
            return None
        if self.window is not None and not self._window_pages_available(
                *self._window_pages_needed(need, num_cached // self.block_size, matched, source_tier is not None)):
            return None
        for node in matched:
            self._ref(node)
            self.queue.refresh(node)
        seq = self.seqs[seq_id] = SequenceBlocks([node.block_id for node in matched], matched, retention=retention)
        keep = {block_hash for block_hash, _, _ in lower}
        if source_tier is not None:
            keep.add(block_hashes[num_cached // self.block_size - 1])
        self._admission_reads = keep  # what the state pool's evictions must not push out of the lower tiers
        if self.states is not None:
            seq.state_row = self.states.take(keep=source)
            if source >= 0:  # resume from the snapshot at the end of the hit
                self.states.touch(source)
                self.state_restores.append(StateCopy(source, seq.state_row))
        self._restore(seq, lower, keep)
        if self.window is not None:  # its window: the device's pages, or fresh ones a lower tier's window fills
            self._start_window(seq_id, seq, source_tier)
        self._admission_reads = set()
        if source_tier is not None and self.states is not None:  # ... copied in before the step's state restores
            self.tiers.restore(source_tier, block_hashes[num_cached // self.block_size - 1], -1, seq.state_row)
        self.tiers.prune(keep)
        self.allocate(seq_id, num_cached + min(len(token_ids) - num_cached, max_new_tokens))
        self._apply_pins(seq)
        stats = self.stats
        if resumed:
            stats.preempted_queries += len(token_ids)
            stats.preempted_hits += num_cached
        else:
            stats.queries += len(token_ids)
            stats.hits += num_cached
        return num_cached

    def _restore(self, seq: SequenceBlocks, lower: list[tuple[BlockHash, TierIndex, TierBlock]],
                 keep: set[BlockHash]) -> None:
        """Copy lower-tier hits into fresh device blocks, as tree nodes the sequence holds. Taking a block may evict
        (and offload) others; the tiers never drop a block (nor snapshot) in ``keep``: this admission reads them."""
        for block_hash, tier, block in lower:
            block_id = self._take_block(keep)
            self.tiers.restore(tier, block_hash, block_id)
            node = self._add_node(block_hash, block_id, block.token_ids, seq.nodes[-1] if seq.nodes else None)
            seq.block_ids.append(block_id)
            seq.nodes.append(node)
            if tier is self.tiers.host:
                self.stats.host_hits += self.block_size
                seq.host_hits += self.block_size
            else:
                self.stats.disk_hits += self.block_size
                seq.disk_hits += self.block_size

    def allocate(self, seq_id: Hashable, num_tokens: int) -> list[int] | None:
        """Make the sequence's blocks cover ``num_tokens`` tokens; returns the block ids appended to its table, or
        None (and nothing changed) if they are not there."""
        seq = self.seqs[seq_id]
        if num_tokens <= len(seq.block_ids) * self.block_size:  # the common case: its last block has room
            return []
        missing = self.blocks_needed(num_tokens) - len(seq.block_ids)
        if missing > self.num_free_blocks:
            return None
        if self.window is not None and not self._window_pages_available(missing):
            return None
        new = [self._take_block() for _ in range(missing)]
        seq.block_ids.extend(new)
        if self.window is not None:
            self._extend_window(seq_id, seq, missing)
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
        first_new = len(seq.nodes)
        while seq.cacheable and len(seq.nodes) < min(num_tokens // bs, len(block_hashes)):
            i = len(seq.nodes)
            block_hash = block_hashes[i]
            block = tuple(token_ids[i * bs : (i + 1) * bs])
            parent = seq.nodes[-1] if seq.nodes else None
            node = (parent.children if parent else self.roots).get(block_hash)
            if node is None:
                node = self._add_node(block_hash, seq.block_ids[i], block, parent)
            elif node.token_ids == block:
                # Another sequence cached the same block first: hold its node (so the path stays whole) but keep
                # computing into our own block, which stays private until we finish: tables never change.
                self._ref(node)
            else:  # a real hash collision: keep this block (and everything after it) private
                seq.cacheable = False
                break
            seq.nodes.append(node)
        if self.window is not None:
            self._attach_window_pages(seq, first_new)
        self._apply_pins(seq)
        if seq.pending_snapshots:
            self._attach_snapshots(seq)

    def take_snapshot(self, seq_id: Hashable, num_tokens: int, replaces_reply: bool = False) -> bool:
        """Keep the state the sequence has after its first ``num_tokens`` tokens (a block boundary, reached by the
        step being scheduled) as a snapshot of that block: a copy after the step's forward, attached to the block's
        node once it is in the tree. ``replaces_reply``: a reply-end snapshot, which drops the sequence's previous
        one. False when no slot could be had or the block has one already."""
        seq, states = self.seqs[seq_id], self.states
        assert states is not None and num_tokens % self.block_size == 0
        index = num_tokens // self.block_size - 1
        if index < len(seq.nodes) and seq.nodes[index].snapshot_row >= 0:
            states.touch(seq.nodes[index].snapshot_row)
            return False
        slot = states.take(spare_branches=self.weigh_snapshots)
        if slot is None:
            return False
        self.state_snapshots.append(StateCopy(seq.state_row, slot))
        seq.pending_snapshots.append((index, slot))
        if replaces_reply:
            self._drop_reply_snapshot(seq)
            seq.reply_snapshot = index
        self._attach_snapshots(seq)
        return True

    def _demote_dominated(self, node: CachedBlock) -> None:
        """A new snapshot at ``node``: the nearest one above it, if no branch lies between them, serves only what
        the new one serves better (a conversation continues from its deepest state), so it goes first when slots
        run short. Snapshots at branch points (a shared system prompt) keep their place."""
        parent = node.parent
        while parent is not None and parent.snapshot_row < 0 and len(parent.children) == 1:
            parent = parent.parent
        if parent is not None and parent.snapshot_row >= 0 and len(parent.children) == 1:
            self.states.demote(parent.snapshot_row)

    def _attach_snapshots(self, seq: SequenceBlocks) -> None:
        pending = []
        for index, slot in seq.pending_snapshots:
            if index >= len(seq.nodes):
                pending.append((index, slot))
            elif seq.nodes[index].snapshot_row >= 0:  # another sequence snapshotted this block first
                self.states.release(slot)
            else:
                node = seq.nodes[index]
                self.states.attach(slot, node)
                self.events.stored(node.block_hash, node.parent_hash, node.token_ids, MEDIUM_DEVICE, snapshot=True)
                if self.weigh_snapshots:
                    self._demote_dominated(node)
        seq.pending_snapshots = pending

    def _drop_reply_snapshot(self, seq: SequenceBlocks) -> None:
        """A newer reply end replaces the previous one, unless a prompt point put it there or it is this step's."""
        index = seq.reply_snapshot
        if 0 <= index < len(seq.nodes):
            node = seq.nodes[index]
            if node.snapshot_row >= 0 and self.states.usable(node):
                self.states.drop(node.snapshot_row)
                self.events.stored(node.block_hash, node.parent_hash, node.token_ids, MEDIUM_DEVICE, snapshot=False)

    def _snapshot_evicted(self, slot: int, node: CachedBlock) -> None:
        """The state pool drops the snapshot in ``slot`` to make room while its block stays: the lower tiers keep
        it (with its block), and the events say the device block has none now."""
        self.tiers.offload(node.block_hash, node.block_id, node.token_ids, node.parent_hash,
                           self._admission_reads, state_row=slot)
        self.events.stored(node.block_hash, node.parent_hash, node.token_ids, MEDIUM_DEVICE, snapshot=False)

    def begin_step(self) -> None:
        """A new scheduler step: the snapshots of the previous one are usable now (their copies ran)."""
        if self.states is not None:
            self.states.step += 1

    def take_state_copies(self) -> tuple[list[StateCopy], list[StateCopy]]:
        """The step's state copies: (restores before its forward, snapshots after it)."""
        copies = (self.state_restores, self.state_snapshots)
        self.state_restores, self.state_snapshots = [], []
        return copies

    def free(self, seq_id: Hashable, hold_s: float = 0.0) -> None:
        """Release a finished, aborted or preempted sequence. Its cached blocks stay in the tree for later hits;
        ``hold_s`` > 0 retains them that long (an agent session waiting on a tool)."""
        seq = self.seqs.pop(seq_id)
        if self.window is not None:
            self._release_window(seq_id, seq)
        if self.states is not None:
            self.states.release(seq.state_row)
            for _, slot in seq.pending_snapshots:  # blocks that never reached the tree (a hash collision)
                self.states.release(slot)
        if hold_s > 0:
            self._retain(seq.nodes, self._now() + hold_s, tenant=seq.retention.tenant if seq.retention else None)
        self.free_block_ids.extend(reversed(seq.private_block_ids()))
        for node in reversed(seq.nodes):  # leaf first, so a parent is never older than its child in LRU order
            self._unref(node)

    def retain_chain(self, block_hashes: Iterable[BlockHash], seconds: float, pin: bool = False,
                     tenant: str | None = None) -> int:
        """Retain the cached blocks of a chain for ``seconds`` from now (``pin``: renewed on every hit, as a
        breakpoint), counted against ``tenant``'s share; ``seconds`` <= 0 ends their retention. Returns how many
        blocks the device holds."""
        nodes = list(itertools.takewhile(lambda n: n is not None, (self.by_hash.get(h) for h in block_hashes)))
        self._retain(nodes, self._now() + seconds, seconds if pin else 0.0, tenant)
        return len(nodes)

    def num_pinned_tokens(self, seq_id: Hashable) -> int:
        """How many leading prompt tokens of ``seq_id`` its breakpoints really retain: up to its last pin's end, or
        to the first block whose retention the cap (or its tenant's share) refused; 0 without pins. What a client
        is told was written to the cache."""
        seq = self.seqs.get(seq_id)
        if seq is None or seq.retention is None or not seq.retention.pins:
            return 0
        end = max(p.num_tokens for p in seq.retention.pins)
        return end if seq.first_pin_refused < 0 else min(end, seq.first_pin_refused * self.block_size)

    def evict(self, num_blocks: int) -> int:
        """Evict up to ``num_blocks`` unreferenced cached blocks (ordinary least recently used leaves first;
        offloaded to the host tier if there is one); returns the count."""
        count = 0
        while count < num_blocks and self._num_unreferenced:
            self.free_block_ids.append(self._evict_one())
            count += 1
        return count

    def reset_prefix_cache(self) -> None:
        """Drop every cached block no sequence holds, in every tier (e.g. between benchmark runs)."""
        mark = len(self.events.events)
        while self._num_unreferenced:
            self.free_block_ids.append(self._evict_one(reset=True))
        self.tiers.clear()
        if not self.by_hash:
            self.events.cleared(since=mark)

    def persist(self) -> None:
        """Write every device-cached block through to the lower tiers (before a shutdown: the disk tier then holds
        the whole cache for the next run)."""
        for node in list(self.by_hash.values()):  # parents before children: insertion order
            self.tiers.offload(node.block_hash, node.block_id, node.token_ids, node.parent_hash,
                               state_row=self._usable_snapshot(node), window_pages=node.window_pages or ())

    def load_disk_tier(self, blocks: Iterable[FoundBlock], reader: Callable[[BlockHash], bool]) -> int:
        """Index the block files a previous run left on disk (oldest first); ``reader`` checks a block's file
        before a hit uses it."""
        self.tiers.disk_reader = reader
        return self.tiers.load_disk(blocks)

    def take_transfers(self) -> list[KVTransfer]:
        return self.tiers.take_transfers()

    def take_events(self) -> list[KVEvent]:
        return self.events.take()

    # ---- internals -------------------------------------------------------------------------------------------
    def _add_node(self, block_hash: BlockHash, block_id: int, token_ids: tuple[int, ...],
                  parent: CachedBlock | None) -> CachedBlock:
        """A new tree node, held by the sequence that computed (or restored) it."""
        node = CachedBlock(block_hash, block_id, token_ids, parent, ref_count=1)
        (parent.children if parent else self.roots)[block_hash] = node
        self.by_hash[block_hash] = node
        node.last_used = node.created = next(self._counter)
        self.events.stored(block_hash, node.parent_hash, token_ids, MEDIUM_DEVICE)
        return node

    def _apply_pins(self, seq: SequenceBlocks) -> None:
        """Pin the sequence's newly cached blocks that its breakpoints cover."""
        retention = seq.retention
        if retention is None or not retention.pins:
            return
        end = min(len(seq.nodes), retention.num_pinned_blocks(self.block_size))
        now = self._now()
        for i in range(seq.num_pinned, end):
            ttl = retention.pin_ttl(i, self.block_size)
            if not self.queue.retain(seq.nodes[i], now + ttl, ttl, retention.tenant) and seq.first_pin_refused < 0:
                seq.first_pin_refused = i
        seq.num_pinned = max(seq.num_pinned, end)

    def _retain(self, nodes: Sequence[CachedBlock], until: float, ttl_s: float = 0.0,
                tenant: str | None = None) -> None:
        for node in nodes:
            self.queue.retain(node, until, ttl_s, tenant)

    def _take_block(self, keep: Collection[BlockHash] = ()) -> int:
        if not self.free_block_ids:
            self.free_block_ids.append(self._evict_one(keep=keep))
        return self.free_block_ids.pop()

    def _ref(self, node: CachedBlock) -> None:
        if node.ref_count == 0:
            self._num_unreferenced -= 1
        node.ref_count += 1
        node.last_used = next(self._counter)

    def _unref(self, node: CachedBlock) -> None:
        node.ref_count -= 1
        assert node.ref_count >= 0
        if node.ref_count == 0:
            self._num_unreferenced += 1
            node.last_used = next(self._counter)
            self.queue.push(node)

    def _evict_one(self, reset: bool = False, keep: Collection[BlockHash] = ()) -> int:
        """Evict the next block of the eviction order; offloaded to the lower tiers unless a ``reset`` drops it."""
        node = self.queue.pop()
        parent = node.parent
        del (parent.children if parent else self.roots)[node.block_hash]
        del self.by_hash[node.block_hash]
        node.in_tree = False
        snapshot = self._usable_snapshot(node)  # (one taken in this step holds nothing yet: it is not kept)
        if node.snapshot_row >= 0:
            self.states.drop(node.snapshot_row)  # its copy to the host, if any, runs before the slot is reused
        window = node.window_pages or ()
        if node.window_pages is not None:
            self.window.drop(node)  # (its pages are copied to the host, if at all, before any is reused)
        if node.window_page >= 0:
            self.window.detach(node)
        if reset:
            self.stats.reset_evictions += 1
        else:
            self.stats.retained_evictions += node.retained
        self.queue.forget(node)
        self._num_unreferenced -= 1
        self.stats.evictions += 1
        self.events.removed(node.block_hash, MEDIUM_DEVICE)
        if not reset:
            self.tiers.offload(node.block_hash, node.block_id, node.token_ids, node.parent_hash, keep, snapshot,
                               window)
        if parent is not None:
            self.queue.push(parent)  # a leaf now, if nothing else holds it
        return node.block_id

    def _usable_snapshot(self, node: CachedBlock) -> int:
        return node.snapshot_row if self.states is not None and self.states.usable(node) else -1

    # ---- invariants (tests and debugging) --------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Assert the block-state partition, reference counts, tree links, retention counts and tier indexes.
        O(blocks); for tests."""
        check_invariants(self, self._num_unreferenced)
