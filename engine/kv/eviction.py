"""The order in which the prefix tree gives up its unreferenced leaves, with retention classes.

Ordinary blocks go first: least recently used (LRU) or oldest cached (FIFO). Retained blocks -- pinned by a
breakpoint or a named cache, or held for an agent session across a tool call -- go only when no ordinary leaf is
left, least recently used first. Retention ends by the clock: an expired block is an ordinary one again. At most
``max_retained`` blocks are retained at once; retaining more is refused (and counted), so pins can never take the
whole pool from ordinary traffic. A retention that names a tenant also counts against that tenant's share,
``max_retained_per_tenant`` blocks: one tenant's breakpoints, sessions and named caches cannot take the whole cap
from the others (a block belongs to one tenant: tenants' cache salts never share a block).

Heap entries are validated lazily: a block's state (references, children, last use, class) may have changed after
it was queued, and then the entry is skipped.
"""
from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING

from engine.config import EvictionPolicy

if TYPE_CHECKING:
    from engine.kv.blocks import CachedBlock


class EvictionQueue:
    def __init__(self, policy: EvictionPolicy, clock: Callable[[], float], max_retained: int,
                 max_retained_per_tenant: int | None = None) -> None:
        self.policy = policy
        self.clock = clock
        self.max_retained = max_retained
        self.max_retained_per_tenant = max_retained if max_retained_per_tenant is None else max_retained_per_tenant
        self.num_retained = 0
        self.retained_by_tenant: dict[str, int] = {}  # blocks each named tenant retains now
        self.refused = 0  # blocks whose retention was refused at the cap
        self._ordinary: list[tuple[int, int, CachedBlock]] = []  # (policy priority, tiebreak, node)
        self._retained: list[tuple[int, int, CachedBlock]] = []  # (last use, tiebreak, node)
        self._expiry: list[tuple[float, int, CachedBlock]] = []  # (retained until, tiebreak, node): every retained one
        self._tiebreak = itertools.count()

    # ---- classes -------------------------------------------------------------------------------------------------
    def retain(self, node: CachedBlock, until: float, ttl_s: float = 0.0, tenant: str | None = None) -> bool:
        """Keep ``node`` retained until ``until`` at least (``ttl_s`` > 0: every hit extends it by that much); an
        ``until`` in the past ends its retention now. False when the cap, or ``tenant``'s share of it, refused it."""
        if until <= self.clock():
            if node.retained:
                self._end_retention(node)
            node.retained_until, node.retain_ttl = 0.0, 0.0
            return True
        newly = not node.retained
        if newly:
            held = 0 if tenant is None else self.retained_by_tenant.get(tenant, 0)
            if self.num_retained >= self.max_retained or held >= self.max_retained_per_tenant:
                self.refused += 1
                return False
            node.retained = True
            self.num_retained += 1
            if tenant is not None:
                self.retained_by_tenant[tenant] = held + 1
                node.retained_by = tenant
        if until > node.retained_until:
            node.retained_until = until
            heapq.heappush(self._expiry, (until, next(self._tiebreak), node))
        node.retain_ttl = max(node.retain_ttl, ttl_s)
        if newly:
            self.push(node)  # into the retained class
        return True

    def refresh(self, node: CachedBlock) -> None:
        """A hit on a pinned block extends its pin by its TTL."""
        if node.retained and node.retain_ttl > 0:
            self.retain(node, self.clock() + node.retain_ttl, node.retain_ttl)

    def expire(self) -> None:
        """Turn every block whose retention ran out into an ordinary one."""
        now = self.clock()
        while self._expiry and self._expiry[0][0] <= now:
            until, _, node = heapq.heappop(self._expiry)
            if node.retained and node.retained_until == until:  # else refreshed (a later entry exists) or ended
                self._end_retention(node)

    def forget(self, node: CachedBlock) -> None:
        """``node`` left the tree."""
        if node.retained:
            self._uncount(node)

    def _end_retention(self, node: CachedBlock) -> None:
        self._uncount(node)
        node.retain_ttl = 0.0
        self.push(node)

    def _uncount(self, node: CachedBlock) -> None:
        node.retained = False
        self.num_retained -= 1
        tenant = node.retained_by
        if tenant is not None:
            node.retained_by = None
            left = self.retained_by_tenant[tenant] - 1
            if left:
                self.retained_by_tenant[tenant] = left
            else:
                del self.retained_by_tenant[tenant]

    # ---- the queue -----------------------------------------------------------------------------------------------
    def _priority(self, node: CachedBlock) -> int:
        return node.last_used if self.policy is EvictionPolicy.LRU or node.retained else node.created

    def push(self, node: CachedBlock) -> None:
        """Queue ``node`` if it is an evictable leaf (no references, no children), in its class."""
        if node.in_tree and not node.ref_count and not node.children:
            heap = self._retained if node.retained else self._ordinary
            heapq.heappush(heap, (self._priority(node), next(self._tiebreak), node))

    def pop(self) -> CachedBlock:
        """The next block to evict (the caller knows there is an unreferenced block, hence a leaf)."""
        self.expire()
        for heap, retained in ((self._ordinary, False), (self._retained, True)):
            while heap:
                priority, _, node = heapq.heappop(heap)
                if (node.in_tree and not node.ref_count and not node.children and node.retained is retained
                        and priority == self._priority(node)):
                    return node
        raise RuntimeError("no evictable block: the caller's count of unreferenced blocks is off")
