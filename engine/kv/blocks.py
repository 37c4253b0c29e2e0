"""The KV manager's records: a cached block (a node of the prefix tree), a live sequence's blocks, the counters."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.kv.block_hashing import BlockHash
from engine.retention import Retention


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
    in_tree: bool = True
    retained: bool = False  # pinned or held (see engine.kv.eviction); counted against the cap
    retained_until: float = 0.0
    retain_ttl: float = 0.0  # a pin's TTL, which every hit renews (0: a hold, not renewed)
    retained_by: str | None = None  # the tenant whose share the retention counts against (None: the cap's alone)
    snapshot_row: int = -1  # hybrid models: the state row holding the recurrent state at this block's end
    snapshot_step: int = 0  # ... taken in this scheduler step (usable from the next one)
    # sliding-window models (engine.kv.window_pool): the page holding this block's window-layer K/V (-1: none now),
    # and the window retained for resuming at this block's end (an anchor: the pages of blocks window_first .. this
    # one; None: none)
    window_page: int = -1
    window_pages: tuple[int, ...] | None = None
    window_first: int = 0

    @property
    def parent_hash(self) -> BlockHash | None:
        return self.parent.block_hash if self.parent is not None else None


@dataclass(frozen=True)
class CachedPrefix:
    """A cached prefix of the device tree: the path from a root to a leaf (`KVCacheManager.cached_prefixes`)."""

    block_hashes: tuple[BlockHash, ...]  # root first
    num_referenced: int  # blocks of the path live sequences hold now
    num_retained: int  # blocks of the path pinned or held for a session
    retained_until: float  # the latest retention end on the path, on the manager's clock (0: none)


@dataclass
class SequenceBlocks:
    """One live sequence's blocks: its block table and the tree path it holds references on."""

    block_ids: list[int] = field(default_factory=list)
    nodes: list[CachedBlock] = field(default_factory=list)
    cacheable: bool = True  # false after a hash collision: later blocks stay private
    retention: Retention | None = None
    num_pinned: int = 0  # leading nodes its pins have been applied to
    first_pin_refused: int = -1  # the first of them whose retention the cap refused (-1: none)
    state_row: int = -1  # hybrid models: the recurrent-state row it runs in (engine.kv.state_pool)
    pending_snapshots: list[tuple[int, int]] = field(default_factory=list)  # (block index, slot) not in the tree yet
    reply_snapshot: int = -1  # the block index of its latest reply-end snapshot (replaced as decoding goes on)
    # sliding-window models: the window layers' page of each block (aligned with block_ids); it holds those from
    # window_from on, the earlier ones (released, or before its hit's window) are NO_PAGE or stale and never read
    window_pages: list[int] = field(default_factory=list)
    window_from: int = 0
    reply_window: CachedBlock | None = None  # the node of its latest reply-end anchor (replaced as it decodes)
    host_hits: int = 0  # tokens of its cached prefix restored from the host tier at admission
    disk_hits: int = 0  # ... and from the disk tier

    def private_block_ids(self) -> list[int]:
        nodes = self.nodes
        return [b for i, b in enumerate(self.block_ids) if i >= len(nodes) or nodes[i].block_id != b]


@dataclass
class CacheStats:
    queries: int = 0  # prompt tokens looked up at first admission
    hits: int = 0  # of those, tokens served from cached blocks
    preempted_queries: int = 0  # tokens looked up when a preempted sequence was re-admitted (counted apart)
    preempted_hits: int = 0
    evictions: int = 0  # cached blocks evicted from the tree (all causes)
    retained_evictions: int = 0  # of those, pinned or held blocks (no ordinary leaf was left)
    reset_evictions: int = 0  # of those, dropped by a prefix-cache reset
    host_hits: int = 0  # tokens restored from the host tier (included in hits / preempted_hits)
    disk_hits: int = 0  # tokens restored from the disk tier

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass(frozen=True)
class KVCounters:
    """What the KV manager reports for the engine's stats: the cache's counters and the sizes of the pool, the lower
    tiers and the snapshots, at one moment."""

    cache: CacheStats
    blocks_total: int
    blocks_free: int
    blocks_cached: int
    blocks_retained: int
    retention_refused_blocks: int
    host_blocks_total: int
    host_blocks_cached: int
    disk_blocks_total: int
    disk_blocks_cached: int
    host_dropped_blocks: int
    disk_dropped_blocks: int
    snapshots_cached: int
    snapshot_evictions: int
