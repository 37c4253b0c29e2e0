"""The recurrent-state group of a hybrid model (Gated DeltaNet layers): a pool of state rows.

A row is one row of every recurrent layer's state tensors (conv window + delta-rule state). Each row is exactly one
of:
  free      -- in the free list;
  running   -- held by a running sequence, whose steps advance the state in it;
  pending   -- a snapshot copied from a running row after a step, waiting for its block to enter the prefix tree;
  snapshot  -- the state at the end of a cached block, owned by that tree node: a prefix hit can resume there.
Snapshots leave least recently used first (those of pinned or held blocks last); a snapshot taken in the current
step is never reused in that step, since its copy runs after the step's forward. Row ids only: the runner owns the
tensors and performs the copies the KV manager asks for (`engine.outputs.StateCopy`).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.kv.blocks import CachedBlock


class StatePool:
    def __init__(self, num_rows: int, on_evict: Callable[[int, CachedBlock], None] | None = None) -> None:
        """``on_evict(row, node)``: called before a snapshot is dropped to make room (the KV manager offloads
        it to the lower tiers)."""
        self.num_rows = num_rows
        self.on_evict = on_evict
        self._free = list(range(num_rows - 1, -1, -1))  # pop() hands out low rows first
        self.snapshots: OrderedDict[int, CachedBlock] = OrderedDict()  # row -> its node, least recently used first
        self.step = 0  # the scheduler's step counter: snapshots of the current step are not usable yet
        self.evictions = 0  # snapshots dropped to make room

    def num_available(self, keep: int = -1) -> int:
        """Rows a sequence could take now: free ones plus evictable snapshots (never ``keep``)."""
        return len(self._free) + sum(1 for row, node in self.snapshots.items()
                                     if row != keep and node.snapshot_step < self.step)

    def take(self, keep: int = -1, spare_branches: bool = False) -> int | None:
        """A free row, evicting the least recently used snapshot if none is (ordinary blocks' before retained
        ones', never ``keep`` nor one taken this step); None when every row is running or pending.
        ``spare_branches``: do not evict a snapshot at a branch point (a block with several children: a state
        several sequences resume from) while such snapshots hold at most half the rows, so stale branches never
        crowd out the newer snapshots of running conversations."""
        if self._free:
            return self._free.pop()
        branches = {row for row, node in self.snapshots.items() if len(node.children) > 1}
        spare = branches if spare_branches and len(branches) <= self.num_rows // 2 else set()
        candidates = [(node.retained, i, row) for i, (row, node) in enumerate(self.snapshots.items())
                      if row != keep and node.snapshot_step < self.step and row not in spare]
        if not candidates:
            return None
        _, _, row = min(candidates)
        if self.on_evict is not None:
            self.on_evict(row, self.snapshots[row])
        self.detach(row)
        self.evictions += 1
        return row

    def release(self, row: int) -> None:
        self._free.append(row)

    def attach(self, row: int, node: CachedBlock) -> None:
        """Row ``row`` holds the state at the end of ``node``'s block (usable from the next step on)."""
        node.snapshot_row, node.snapshot_step = row, self.step
        self.snapshots[row] = node

    def touch(self, row: int) -> None:
        self.snapshots.move_to_end(row)

    def demote(self, row: int) -> None:
        """Make the snapshot the next to go (another one on the same path serves its purpose better)."""
        self.snapshots.move_to_end(row, last=False)

    def detach(self, row: int) -> None:
        """The snapshot in ``row`` is gone (its node left the tree, or the row is reused): the node forgets it."""
        node = self.snapshots.pop(row)
        node.snapshot_row = -1

    def drop(self, row: int) -> None:
        self.detach(row)
        self._free.append(row)

    def usable(self, node: CachedBlock) -> bool:
        return node.snapshot_row >= 0 and node.snapshot_step < self.step

    def check_invariants(self, running: list[int], pending: list[int]) -> None:
        """``running``: the rows sequences run in; ``pending``: snapshots not attached to a node yet."""
        held = running + pending + list(self.snapshots)
        assert len(set(held)) == len(held), "a state row is held twice"
        assert not set(held) & set(self._free), "a state row is both free and held"
        assert len(held) + len(self._free) == self.num_rows, "a state row is lost"
        for row, node in self.snapshots.items():
            assert node.in_tree and node.snapshot_row == row, "a snapshot's node left the tree or forgot it"
