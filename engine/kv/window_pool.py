"""The sliding-window cache group: the pages of a model's sliding-window layers (Gemma 3's local layers, gpt-oss'
banded ones), apart from the full-attention pages the prefix tree holds.

A query at position p of a window layer reads keys in ``(p - window, p]`` only, so a running sequence needs that
layer's K/V for its last ``window - 1`` positions, not for its whole context. The window layers therefore keep their
K/V in pages of their own (``num_pages`` of them, each ``block_size`` tokens of every window layer), one per logical
block of a sequence, and a sequence lets a page go once no query it will compute reads it: a 100k-token session
holds about ``window / block_size + 2`` pages in these layers instead of 100k / ``block_size``.

A prefix hit at position P (a block boundary) needs full-attention pages for ``[0, P)`` and window pages for
``(P - window, P)``: blocks ``first_window_block(P)`` to ``P / block_size - 1``. A cached block's node names the page
that holds its window K/V (``CachedBlock.window_page``, set when the block is committed), so a hit can end wherever
the pages of its window are all still there. Every page is exactly one of
  free      -- in the free list, no node names it;
  held      -- referenced (``refs[page]`` > 0) by running sequences (the part of their window table they read) and by
               retained windows;
  cached    -- referenced by nobody but still named by its block's node: a hit may take it back, and it is the first
               to be reused (least recently released first), as vLLM keeps freed blocks.
A **retained window** (an *anchor*) holds the pages of ``(P - window, P)`` for the node of the block ending at P, so
that a request resuming there finds them whatever else is reused: anchors are taken at the boundaries worth resuming
from (`engine.kv.snapshot_policy`: prompt ends, reply ends, breakpoints, server hints). Anchors overlap (consecutive
reply ends share all but one page), so an anchor's cost is the pages only it holds. A new page is a free one, else
the oldest cached one, else one an anchor gives up; and while anchors alone hold more than ``ANCHOR_SHARE`` of the
pages, an anchor gives one up before any cached page is reused (one at a branch point, a block several requests went
on from, is spared then). The anchor that goes is the first, in least-recently-used order (ordinary blocks' before
pinned or session-held ones', those superseded by a deeper anchor on the same unbranched path first), whose pages
only it holds: one whose pages others hold too costs nothing and is kept, unless no page is left at all and
anchors overlapping one another hold every page no sequence holds (then the first holding such a page goes, and so
on until one frees). Page ids only; the runner owns the tensors.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.kv.blocks import CachedBlock

# Retained windows may hold at most this share of the pages alone while cached pages are there to reuse: beyond it the
# oldest retained window not at a branch point goes first (a 1024-token window costs 64 pages: unbounded, stale
# ones crowded out the cached pages later requests diverge at; docs/SLIDING_WINDOW.md)
ANCHOR_SHARE = 0.25
NO_PAGE = 0  # what a block table holds where a sequence has no window page: no query of it ever reads there
# The share of the KV memory, after the running sequences' windows, that window pages get for retained and cached
# windows (--window-retention-fraction): on interleaved agent sessions of a few windows each, 0.5 keeps 88-98% of
# the hits a dense model gets in the same memory, 0.2 only 63-96% (docs/SLIDING_WINDOW.md)
DEFAULT_RETENTION_FRACTION = 0.5


def first_window_block(num_tokens: int, window: int, block_size: int) -> int:
    """The first block a query at position ``num_tokens`` reads in a window layer (its window's first key,
    ``num_tokens - window + 1``, lies in it)."""
    return max(0, num_tokens - window + 1) // block_size


def pages_per_window(window: int, block_size: int) -> int:
    """The most pages a resume reads in the window layers, ``ceil((window - 1) / block_size)`` (at least one): the
    blocks from `first_window_block` to the one ending at the resume point, far enough into a sequence. What a
    lower tier's window row holds (`engine.kv.tiers`)."""
    return max(1, -(-(window - 1) // block_size))


def step_pages(window: int, block_size: int, num_tokens: int) -> int:
    """The most window pages one sequence holds in a step computing ``num_tokens`` tokens: the blocks of the window
    a resume at its last block boundary reads (`pages_per_window`, kept by `slide`) and those the step writes,
    starting anywhere in a block."""
    return pages_per_window(window, block_size) + -(-(block_size - 1 + num_tokens) // block_size)


@dataclass(frozen=True)
class WindowBudget:
    """What one sequence may ever need of a sliding-window model's window pool, so that a request whose step can
    never fit is refused when it arrives instead of waiting forever for pages no finishing request frees (the
    full-attention blocks' check is `engine.requests.RequestPreparer.validate`'s)."""

    window: int  # the widest window of the model's window layers, in tokens
    block_size: int
    num_pages: int  # the window pool's pages
    max_step_tokens: int  # one sequence's tokens in a step at most: --max-num-batched-tokens

    def pages_needed(self, num_tokens: int) -> int:
        """The most pages a sequence of ``num_tokens`` tokens (prompt and output) holds in one step."""
        whole = -(-num_tokens // self.block_size)  # it never has more blocks than that
        return min(whole, step_pages(self.window, self.block_size, min(self.max_step_tokens, num_tokens)))

    def refusal(self, num_tokens: int) -> str | None:
        """Why a sequence of ``num_tokens`` tokens can never run in this pool, with the way out; None if it can."""
        need = self.pages_needed(num_tokens)
        if need <= self.num_pages:
            return None
        # the longest step that fits: its blocks beyond the window's, starting mid-block
        fits = (self.num_pages - pages_per_window(self.window, self.block_size)) * self.block_size - self.block_size + 1
        smaller = (f"or lower --max-num-batched-tokens to {fits} or less" if fits > 0 else
                   "(no smaller step fits: the pool holds less than a window and a block)")
        return (f"a step of this request ({num_tokens} tokens with its output, in steps of up to "
                f"{self.max_step_tokens}) holds up to {need} sliding-window KV pages ({self.window}-token window, "
                f"blocks of {self.block_size}) but the window pool has {self.num_pages}; give it more pages "
                f"(--num-window-blocks, or leave that unset to size the pool from the KV memory) {smaller}")


class WindowPool:
    def __init__(self, num_pages: int, window: int, block_size: int,
                 on_drop: Callable[[CachedBlock], None] | None = None) -> None:
        """``window``: the widest window of the model's window layers, in tokens. ``on_drop(node)``: called when an
        anchor is evicted to make room (the KV manager publishes it)."""
        assert window >= 1 and num_pages >= 1
        self.num_pages = num_pages
        self.window = window
        self.block_size = block_size
        self.on_drop = on_drop
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low pages first
        self.refs = [0] * num_pages
        self.anchor_refs = [0] * num_pages  # of refs, the anchors'
        self.num_anchored_only = 0  # pages only anchors hold
        self.owner: list[CachedBlock | None] = [None] * num_pages  # the node whose block's K/V the page holds
        self.cached: OrderedDict[int, None] = OrderedDict()  # unreferenced pages nodes still name, oldest first
        self.anchors: OrderedDict[CachedBlock, None] = OrderedDict()  # least recently used first
        self.evictions = 0  # anchors dropped to make room

    # ---- queries ---------------------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Pages a sequence can take without dropping an anchor: free ones and cached ones."""
        return len(self._free) + len(self.cached)

    @property
    def free_pages(self) -> list[int]:
        """The pages nobody holds nor names: no query reads them before they are handed out and written again."""
        return list(self._free)

    def first_block(self, num_tokens: int) -> int:
        return first_window_block(num_tokens, self.window, self.block_size)

    # ---- pages -----------------------------------------------------------------------------------------------------
    def take(self) -> int | None:
        """A page for new K/V (its one reference is the caller's): a free one, else the oldest cached one (its node
        forgets it; first an anchor gives pages up while anchors alone hold more than ``ANCHOR_SHARE`` of them),
        else one an evicted anchor gives up; None when every page is held by running sequences or by anchors that
        cannot give one up alone."""
        while not self._free and (not self.cached or self.num_anchored_only > self.num_pages * ANCHOR_SHARE):
            if not self._evict_one(spare_branches=bool(self.cached)):
                if not self.cached:
                    return None
                break
        if self._free:
            page = self._free.pop()
        else:
            page, _ = self.cached.popitem(last=False)
            self._forget(page)
        self.refs[page] = 1
        return page

    def ref(self, page: int, anchor: bool = False) -> None:
        """One more holder of ``page`` (``anchor``: a retained window; else a running sequence)."""
        if self.refs[page] == 0:
            assert page in self.cached, "a free window page is referenced"
            del self.cached[page]
        before = self._anchored_only(page)
        self.refs[page] += 1
        self.anchor_refs[page] += anchor
        self.num_anchored_only += self._anchored_only(page) - before

    def _anchored_only(self, page: int) -> bool:
        return self.refs[page] > 0 and self.refs[page] == self.anchor_refs[page]

    def unref(self, page: int, anchor: bool = False) -> None:
        """One holder less; at none the page is cached if its block's node names it, else free."""
        before = self._anchored_only(page)
        self.refs[page] -= 1
        self.anchor_refs[page] -= anchor
        self.num_anchored_only += self._anchored_only(page) - before
        assert self.refs[page] >= 0
        if self.refs[page] == 0:
            if self.owner[page] is not None:
                self.cached[page] = None
            else:
                self._free.append(page)

    def attach(self, node: CachedBlock, page: int) -> None:
        """``page`` holds the window K/V of ``node``'s block (just committed; the page is held)."""
        assert node.window_page < 0 and self.refs[page] > 0 and self.owner[page] is None
        node.window_page = page
        self.owner[page] = node

    def detach(self, node: CachedBlock) -> None:
        """``node`` leaves the tree: its page (if any) is nobody's any more."""
        page = node.window_page
        self._forget(page)
        if self.refs[page] == 0:
            del self.cached[page]
            self._free.append(page)

    def _forget(self, page: int) -> None:
        self.owner[page].window_page = -1
        self.owner[page] = None

    # ---- anchors ---------------------------------------------------------------------------------------------------
    def anchor(self, node: CachedBlock, first: int, pages: list[int]) -> bool:
        """Keep ``pages`` (the window pages of blocks ``first ..``, ending with ``node``'s block) for resuming at the
        end of ``node``'s block. False if the node has an anchor already (it is refreshed)."""
        if node.window_pages is not None:
            self.touch(node)
            return False
        for page in pages:
            self.ref(page, anchor=True)
        node.window_first, node.window_pages = first, tuple(pages)
        self.anchors[node] = None
        return True

    def touch(self, node: CachedBlock) -> None:
        self.anchors.move_to_end(node)

    def demote(self, node: CachedBlock) -> None:
        """Make the anchor the next to go (a deeper one on the same path serves its purpose better)."""
        self.anchors.move_to_end(node, last=False)

    def drop(self, node: CachedBlock) -> None:
        """Release the node's anchor (the node leaves the tree, or a newer reply end replaces it); its pages stay
        cached while nobody else needs them."""
        del self.anchors[node]
        pages, node.window_pages = node.window_pages, None
        for page in pages:
            self.unref(page, anchor=True)

    def _evict_one(self, spare_branches: bool = False) -> bool:
        """Drop the first anchor in eviction order whose pages only it holds (``spare_branches``: not one at a
        branch point); False if none does. Not sparing branches, else the first with a page only anchors hold:
        anchors overlapping along a path (a prompt end, the reply end a block on, a preemption point) can cover
        each other's every page, and none would give one up while the pool has no other page to hand out."""
        order = [node for _, node in sorted(enumerate(self.anchors), key=lambda item: (item[1].retained, item[0]))
                 if not (spare_branches and len(node.children) > 1)]
        victim = next((node for node in order if any(self.refs[page] == 1 for page in node.window_pages)), None)
        if victim is None and not spare_branches:
            victim = next((node for node in order if any(self._anchored_only(page) for page in node.window_pages)),
                          None)
        if victim is None:
            return False
        if self.on_drop is not None:
            self.on_drop(victim)
        self.drop(victim)
        self.evictions += 1
        return True

    # ---- invariants ------------------------------------------------------------------------------------------------
    def check_invariants(self, running: list[list[int]]) -> None:
        """``running``: the pages each live sequence holds (its window table's live part). Every page is free,
        held or cached; its reference count is its holders'; a page and the node naming it agree."""
        holders = [0] * self.num_pages
        for pages in running:
            for page in pages:
                holders[page] += 1
        for node in self.anchors:
            assert node.in_tree and node.window_pages is not None, "an anchor's node left the tree or forgot it"
            for page in node.window_pages:
                holders[page] += 1
        assert holders == self.refs, "a window page's reference count is not its holders'"
        anchored = [0] * self.num_pages
        for node in self.anchors:
            for page in node.window_pages:
                anchored[page] += 1
        assert anchored == self.anchor_refs, "a window page's anchor count is off"
        assert self.num_anchored_only == sum(r > 0 and r == a for r, a in zip(self.refs, anchored))
        free = set(self._free)
        assert len(free) == len(self._free), "a window page is free twice"
        for page in range(self.num_pages):
            owner = self.owner[page]
            assert owner is None or (owner.in_tree and owner.window_page == page), "a page and its node disagree"
            state = (page in free) + (page in self.cached) + (self.refs[page] > 0)
            assert state == 1, f"window page {page} is not exactly one of free / cached / held"
            assert (page in free) == (owner is None and not self.refs[page]), "a free page is named or held"
