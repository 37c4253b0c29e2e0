"""The KV manager's side of the sliding-window group (`engine.kv.window_pool`), mixed into `KVCacheManager`.

A sliding-window model's sequence has two block tables of the same length: its full-attention blocks (the prefix
tree's, as for every model) and its window pages (``SequenceBlocks.window_pages``), one per logical block, of which it
holds only those from ``window_from`` on. The scheduler drives it:
  - admission (`KVCacheManager.admit`) ends a hit at the deepest matched block with an anchor (a retained window)
    and starts the window table there: no page before the anchor's window, the anchor's pages, then new ones;
  - `slide` before each step releases the pages no query of the sequence reads any more, keeping those a resume at
    its last block boundary needs (so a preemption can leave an anchor there);
  - `keep_window` retains the window at a block boundary the policy wants (`engine.kv.snapshot_policy`), a reply
    end replacing the sequence's previous one;
  - the window pages appended to each sequence's table in a step are handed to the runner as deltas
    (`take_window_blocks`), as block ids are.
Lower tiers do not carry window pages: a sliding-window model's hits are the device's.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

from engine.kv.blocks import CachedBlock, SequenceBlocks
from engine.kv.events import MEDIUM_DEVICE
from engine.kv.window_pool import NO_PAGE, WindowPool

if TYPE_CHECKING:
    from engine.kv.events import EventRecorder


class WindowCache:
    window: WindowPool | None
    seqs: dict[Hashable, SequenceBlocks]
    block_size: int
    events: EventRecorder
    weigh_snapshots: bool
    window_deltas: dict[Hashable, list[int]]

    # ---- hits ------------------------------------------------------------------------------------------------------
    @staticmethod
    def _window_hit(matched: list[CachedBlock]) -> list[CachedBlock]:
        """A hit cut at the deepest matched block whose window is retained (none: no hit)."""
        for i in range(len(matched), 0, -1):
            if matched[i - 1].window_pages is not None:
                return matched[:i]
        return []

    def _window_pages_available(self, needed: int, keep: Sequence[int] = ()) -> bool:
        """Whether ``needed`` window pages can be had: free ones, then those that dropping anchors frees (pages no
        running sequence holds), never ``keep`` (the pages an admission is about to hold)."""
        pool = self.window
        if pool.num_free >= needed:
            return True
        anchored = [0] * pool.num_pages
        for node in pool.anchors:
            for page in node.window_pages:
                anchored[page] += 1
        kept = set(keep)
        freeable = sum(1 for page, refs in enumerate(pool.refs) if refs and refs == anchored[page] and page not in kept)
        return pool.num_free + freeable >= needed

    def _start_window(self, seq_id: Hashable, seq: SequenceBlocks) -> None:
        """An admitted sequence's window table up to its hit: nothing before the anchor's window, then its pages."""
        if seq.nodes:
            anchor = seq.nodes[-1]
            for page in anchor.window_pages:
                self.window.ref(page)
            self.window.touch(anchor)
            seq.window_from = anchor.window_first
            seq.window_pages = [NO_PAGE] * anchor.window_first + list(anchor.window_pages)
        self.window_deltas[seq_id] = list(seq.window_pages)

    def _extend_window(self, seq_id: Hashable, seq: SequenceBlocks, count: int) -> None:
        """``count`` new pages at the end of the sequence's window table (their availability was checked)."""
        new = [self.window.take() for _ in range(count)]
        assert None not in new, "window pages ran out after the check"
        seq.window_pages.extend(new)
        self.window_deltas.setdefault(seq_id, []).extend(new)

    def _release_window(self, seq_id: Hashable, seq: SequenceBlocks) -> None:
        for page in seq.window_pages[seq.window_from:]:
            self.window.unref(page)
        seq.window_from = len(seq.window_pages)
        self.window_deltas.pop(seq_id, None)

    # ---- the scheduler's calls -------------------------------------------------------------------------------------
    def slide(self, seq_id: Hashable, num_computed: int) -> None:
        """The sequence's next step starts after ``num_computed`` tokens: release the window pages that neither its
        queries from there on nor a resume at its last block boundary read. No-op without a window group."""
        if self.window is None:
            return
        seq = self.seqs[seq_id]
        first = min(self.window.first_block(num_computed // self.block_size * self.block_size),
                    len(seq.window_pages))
        for page in seq.window_pages[seq.window_from:first]:
            self.window.unref(page)
        seq.window_from = max(seq.window_from, first)

    def keep_window(self, seq_id: Hashable, num_tokens: int, replaces_reply: bool = False) -> bool:
        """Retain the window at the block boundary ``num_tokens`` (a block the sequence has committed) so that a
        later request can resume there. ``replaces_reply``: a reply end, which releases the sequence's previous
        one. False if there was nothing to retain (no such block, its pages released, or an anchor there already)."""
        if self.window is None:
            return False
        seq, bs = self.seqs[seq_id], self.block_size
        k = num_tokens // bs
        first = self.window.first_block(k * bs)
        if k == 0 or k > len(seq.nodes) or first < seq.window_from:
            return False
        node = seq.nodes[k - 1]
        made = self.window.anchor(node, first, seq.window_pages[first:k])
        if made:
            self.events.stored(node.block_hash, node.parent_hash, node.token_ids, MEDIUM_DEVICE, snapshot=True)
            if self.weigh_snapshots:
                self._demote_dominated_window(node)
        if replaces_reply:
            previous = seq.reply_window
            if previous is not None and previous is not node and previous.window_pages is not None:
                self._drop_anchor(previous)
            seq.reply_window = node if made else None
        return made

    def take_window_blocks(self) -> dict[Hashable, list[int]]:
        """The window pages appended to each sequence's table since the last call (a (re)admitted sequence's whole
        table), for the runner."""
        deltas, self.window_deltas = self.window_deltas, {}
        return deltas

    def window_table(self, seq_id: Hashable) -> list[int]:
        return self.seqs[seq_id].window_pages

    # ---- anchors ---------------------------------------------------------------------------------------------------
    def _drop_anchor(self, node: CachedBlock) -> None:
        self.window.drop(node)
        self._window_dropped(node)

    def _window_dropped(self, node: CachedBlock) -> None:
        """The node's retained window is gone while the node stays: the events say it is no resume point now."""
        self.events.stored(node.block_hash, node.parent_hash, node.token_ids, MEDIUM_DEVICE, snapshot=False)

    def _demote_dominated_window(self, node: CachedBlock) -> None:
        """A new anchor at ``node``: the nearest one above it, with no branch between them, serves only what the
        new one serves better, so it goes first when pages run short (an anchor at a branch keeps its place)."""
        parent = node.parent
        while parent is not None and parent.window_pages is None and len(parent.children) == 1:
            parent = parent.parent
        if parent is not None and parent.window_pages is not None and len(parent.children) == 1:
            self.window.demote(parent)


def check_window_invariants(pool: WindowPool, seqs: Sequence[SequenceBlocks], block_size: int) -> None:
    """Each live sequence's window table is as long as its block table, and holds pages from ``window_from``; each
    anchor's pages are the window of its block's end; every page's reference count is its holders'."""
    for seq in seqs:
        assert len(seq.window_pages) == len(seq.block_ids), "window table and block table differ in length"
        assert seq.window_from <= len(seq.window_pages)
    for node in pool.anchors:
        depth, parent = 1, node.parent
        while parent is not None:
            depth, parent = depth + 1, parent.parent
        assert node.window_first == pool.first_block(depth * block_size), "an anchor's window starts elsewhere"
        assert len(node.window_pages) == depth - node.window_first, "an anchor's window is not its block's"
    pool.check_invariants([seq.window_pages[seq.window_from:] for seq in seqs])
