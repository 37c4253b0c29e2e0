"""What the rest of the engine asks of the scheduler's KV manager, through the scheduler that owns it: what the prefix
cache would serve, pins, resets, the tiers' traffic outside a step, and every counter `/metrics` shows.

`SchedulerQueries` is a part of `engine.sched.scheduler.Scheduler`, split off so that the scheduler's module reads as
the algorithm.
"""
from __future__ import annotations

from collections import abc
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import TYPE_CHECKING

from engine.kv.block_hashing import BlockHash
from engine.kv.blocks import CacheStats
from engine.kv.events import KVEvent
from engine.kv.manager import PrefixCacheView
from engine.kv.tiers import FoundBlock
from engine.multimodal import ImageInput
from engine.outputs import KVTransfer, SchedulerStats

if TYPE_CHECKING:
    from engine.sched.scheduler import Scheduler


class SchedulerQueries:
    """Mixed into `Scheduler` (whose attributes it reads: see the module docstring)."""

    def num_cached_tokens(self: Scheduler, token_ids: abc.Sequence[int], cache_salt: str | None,
                          images: abc.Sequence[ImageInput] = ()) -> int:
        """How many tokens of ``token_ids`` (with its ``images``) the prefix cache would serve now (/tokenize)."""
        return self.kv.num_cached_tokens(self.hasher.hashes(token_ids, cache_salt, images), len(token_ids))

    def reset_prefix_cache(self: Scheduler) -> None:
        """Drop every cached block no sequence holds, in every tier (between benchmark runs)."""
        self.kv.reset_prefix_cache()

    def blocks_needed(self: Scheduler, num_tokens: int) -> int:
        return self.kv.blocks_needed(num_tokens)

    @property
    def num_blocks(self: Scheduler) -> int:
        return self.kv.num_blocks

    @property
    def prefix_cache(self: Scheduler) -> PrefixCacheView:
        """The prefix cache's read-only queries (where a chain is cached, its largest prefixes)."""
        return self.kv

    def pin(self: Scheduler, block_hashes: list[BlockHash], ttl_s: float) -> int:
        """Pin the cached blocks of a chain for ``ttl_s`` seconds (0: unpin); returns how many the device holds."""
        return self.kv.retain_chain(block_hashes, ttl_s, pin=True)

    def cache_stats(self: Scheduler) -> CacheStats:
        return replace(self.kv.stats)

    def take_transfers(self: Scheduler) -> list[KVTransfer]:
        """Copies between KV tiers queued outside a step (a reset, persisting, loading the disk tier)."""
        return self.kv.take_transfers()

    def take_kv_events(self: Scheduler) -> list[KVEvent]:
        return self.kv.take_events()

    def load_disk_tier(self: Scheduler, reader: Callable[[BlockHash], bool], blocks: Iterable[FoundBlock]) -> None:
        """Index the blocks a previous run left on disk; ``reader`` checks a block's file before a hit uses it."""
        self.kv.load_disk_tier(blocks, reader)

    def persist(self: Scheduler) -> None:
        """Write the device-cached blocks through to the disk tier (at shutdown)."""
        self.kv.persist()

    def stats(self: Scheduler) -> SchedulerStats:
        kv = self.kv.counters()
        cache = kv.cache
        return SchedulerStats(
            prefix_cache_queries_tokens=cache.queries,
            prefix_cache_hits_tokens=cache.hits,
            prefix_cache_preempted_queries_tokens=cache.preempted_queries,
            prefix_cache_preempted_hits_tokens=cache.preempted_hits,
            prefix_cache_evictions=cache.evictions,
            prefix_cache_retained_evictions=cache.retained_evictions,
            prefix_cache_reset_evictions=cache.reset_evictions,
            prefix_cache_host_hits_tokens=cache.host_hits,
            prefix_cache_disk_hits_tokens=cache.disk_hits,
            state_snapshots_cached=kv.snapshots_cached,
            state_snapshot_evictions=kv.snapshot_evictions,
            kv_blocks_total=kv.blocks_total,
            kv_blocks_free=kv.blocks_free,
            kv_blocks_cached=kv.blocks_cached,
            kv_blocks_retained=kv.blocks_retained,
            kv_retention_refused_blocks=kv.retention_refused_blocks,
            kv_host_blocks_total=kv.host_blocks_total,
            kv_host_blocks_cached=kv.host_blocks_cached,
            kv_disk_blocks_total=kv.disk_blocks_total,
            kv_disk_blocks_cached=kv.disk_blocks_cached,
            kv_host_dropped_blocks=kv.host_dropped_blocks,
            kv_disk_dropped_blocks=kv.disk_dropped_blocks,
            requests_running=len(self.running),
            requests_waiting=len(self.waiting),
            prompt_tokens=self.num_prompt_tokens,
            generation_tokens=self.num_generation_tokens,
            preemptions=self.num_preemptions,
            spec_verifications=sum(s.verifications for s in self.drafter.stats.values()),
            spec_draft_tokens=sum(s.draft_tokens for s in self.drafter.stats.values()),
            spec_accepted_tokens=sum(s.accepted_tokens for s in self.drafter.stats.values()),
            decode_steps=self.num_decode_steps,
        )
