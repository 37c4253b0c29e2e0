"""The KV manager's side of the sliding-window group (`engine.kv.window_pool`), mixed into `KVCacheManager`.

A sliding-window model's sequence has two block tables of the same length: its full-attention blocks (the prefix
tree's, as for every model) and its window pages (``SequenceBlocks.window_pages``), one per logical block, of which it
holds only those from ``window_from`` on. The scheduler drives it:
  - admission (`KVCacheManager.admit`) ends a hit at the deepest matched block whose window's pages are all still
    there (held, cached, or kept by an anchor: a retained window), or deeper where a lower tier holds the window
    (and the blocks up to it), and starts the window table there: no page before that window, its pages (a tier's
    window is copied into fresh ones), then new ones;
  - a committed block's node names the sequence's page of it (`_attach_window_pages`), which stays cached after the
    sequence lets it go, until the page is reused;
  - `slide` before each step releases the pages no query of the sequence reads any more, keeping those a resume at
    its last block boundary needs (so a preemption can leave an anchor there);
  - `keep_window` retains the window at a block boundary the policy wants (`engine.kv.snapshot_policy`), a reply
    end replacing the sequence's previous one;
  - the window pages appended to each sequence's table in a step are handed to the runner as deltas
    (`take_window_blocks`), as block ids are.
An anchor that leaves the device (its block evicted, or its pages needed) goes to the host tier with its block, as a
hybrid's snapshot does (`engine.kv.tiers`: a tier's state rows hold retained windows), and on to disk.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

from engine.kv.blocks import CachedBlock, SequenceBlocks
from engine.kv.events import MEDIUM_DEVICE
from engine.kv.window_pool import NO_PAGE, WindowPool

if TYPE_CHECKING:
    from engine.kv.block_hashing import BlockHash
    from engine.kv.events import EventRecorder
    from engine.kv.tiers import LowerTiers, TierIndex


class WindowCache:
    window: WindowPool | None
    seqs: dict[Hashable, SequenceBlocks]
    block_size: int
    events: EventRecorder
    weigh_snapshots: bool
    window_deltas: dict[Hashable, list[int]]
    tiers: LowerTiers
    _admission_reads: set[BlockHash]

    # ---- hits ------------------------------------------------------------------------------------------------------
    def _window_hit(self, matched: list[CachedBlock]) -> list[CachedBlock]:
        """A hit cut at the deepest matched block whose window's pages are all there (none: no hit). O(blocks)."""
        deepest, run = 0, 0  # run: consecutive blocks with a page, ending at block k - 1
        for k, node in enumerate(matched, 1):
            run = run + 1 if node.window_page >= 0 else 0
            if run >= k - self.window.first_block(k * self.block_size):
                deepest = k
        return matched[:deepest]

    def _window_pages_available(self, needed: int, keep: Sequence[int] = ()) -> bool:
        """Whether ``needed`` window pages can be had: free ones, then those that dropping anchors frees (pages no
        running sequence holds), never ``keep`` (the pages an admission is about to hold)."""
        pool, kept = self.window, set(keep)
        available = pool.num_free - sum(1 for page in kept if page in pool.cached)
        if available >= needed:
            return True
        anchored = [0] * pool.num_pages
        for node in pool.anchors:
            for page in node.window_pages:
                anchored[page] += 1
        freeable = sum(1 for page, refs in enumerate(pool.refs) if refs and refs == anchored[page] and page not in kept)
        return available + freeable >= needed

    def _window_pages_needed(self, need: int, hit: int, matched: list[CachedBlock], from_tier: bool
                             ) -> tuple[int, list[int]]:
        """(pages to take, pages to keep) for an admission holding ``need`` blocks with a hit of ``hit`` blocks:
        a page for each block after the hit, and one for each block of the hit's window when a lower tier holds it
        (else the device's pages of that window are kept)."""
        if from_tier:
            return need - self.window.first_block(hit * self.block_size), []
        return need - hit, self._hit_pages(matched) if matched else []

    def _start_window(self, seq_id: Hashable, seq: SequenceBlocks, tier: TierIndex | None = None) -> None:
        """An admitted sequence's window table up to its hit: nothing before the hit's window, then its pages: the
        device's, or (``tier``: the tier holding the window at the hit's end) fresh ones the tier's window is copied
        into, which the hit's blocks without a page of their own name from now on."""
        if seq.nodes:
            first = self.window.first_block(len(seq.nodes) * self.block_size)
            if tier is None:
                pages = self._hit_pages(seq.nodes)
                for page in pages:
                    self.window.ref(page)
                if seq.nodes[-1].window_pages is not None:
                    self.window.touch(seq.nodes[-1])
            else:
                pages = [self.window.take() for _ in range(first, len(seq.nodes))]
                assert None not in pages, "window pages ran out after the check"
                for node, page in zip(seq.nodes[first:], pages):
                    if node.window_page < 0:
                        self.window.attach(node, page)
                self.tiers.restore(tier, seq.nodes[-1].block_hash, -1, window_pages=tuple(pages))
            seq.window_from = first
            seq.window_pages = [NO_PAGE] * first + pages
        self.window_deltas[seq_id] = list(seq.window_pages)

    def _hit_pages(self, nodes: Sequence[CachedBlock], k: int | None = None) -> list[int]:
        """The window pages a hit ending with ``nodes[k - 1]`` (default: the last) reads: its last ``window - 1``
        tokens' blocks. O(window), whatever the context."""
        k = len(nodes) if k is None else k
        return [nodes[i].window_page for i in range(self.window.first_block(k * self.block_size), k)]

    def _attach_window_pages(self, seq: SequenceBlocks, start: int) -> None:
        """The sequence's newly committed blocks from ``start`` on: each node without a page names the sequence's
        (another sequence's page of the same block may be there already; then the sequence's own stays private)."""
        for i in range(max(start, seq.window_from), len(seq.nodes)):
            if seq.nodes[i].window_page < 0:
                self.window.attach(seq.nodes[i], seq.window_pages[i])

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
        if k == 0 or k > len(seq.nodes):
            return False
        pages = self._hit_pages(seq.nodes, k)
        if min(pages) < 0:  # a page of the window is gone (released and reused)
            return False
        node = seq.nodes[k - 1]
        made = self.window.anchor(node, first, pages)
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

    def _anchor_evicted(self, node: CachedBlock) -> None:
        """The window pool drops the node's anchor to make room while the node stays: the lower tiers keep the
        window (with its block), as a hybrid's snapshot that leaves its row."""
        self.tiers.offload(node.block_hash, node.block_id, node.token_ids, node.parent_hash, self._admission_reads,
                           window_pages=node.window_pages)
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
    anchor's pages are those its window's nodes name; every page's reference count is its holders'."""
    for seq in seqs:
        assert len(seq.window_pages) == len(seq.block_ids), "window table and block table differ in length"
        assert seq.window_from <= len(seq.window_pages)
    for node in pool.anchors:
        path: list[CachedBlock] = []
        walk: CachedBlock | None = node
        while walk is not None:
            path.append(walk)
            walk = walk.parent
        path.reverse()
        assert node.window_first == pool.first_block(len(path) * block_size), "an anchor's window starts elsewhere"
        assert node.window_pages == tuple(n.window_page for n in path[node.window_first:]), \
            "an anchor's pages are not its window's"
    pool.check_invariants([seq.window_pages[seq.window_from:] for seq in seqs])
