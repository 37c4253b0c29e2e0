"""The sliding-window cache group: the pages of a model's sliding-window layers (Gemma 3's local layers, gpt-oss'
banded ones), apart from the full-attention pages the prefix tree holds.

A query at position p of a window layer reads keys in ``(p - window, p]`` only, so a running sequence needs that
layer's K/V for its last ``window - 1`` positions, not for its whole context. The window layers therefore keep their
K/V in pages of their own (``num_pages`` of them, each ``block_size`` tokens of every window layer), one per logical
block of a sequence, and a sequence releases a page once no query it will compute reads it: a 100k-token session
holds about ``window / block_size + 2`` pages in these layers instead of 100k / ``block_size``.

A prefix hit at position P (a block boundary) needs full-attention pages for ``[0, P)`` and window pages for
``(P - window, P)``: blocks ``first_window_block(P)`` to ``P / block_size - 1``. A **retained window** (an *anchor*)
keeps those pages for one tree node, the block ending at P, so that a later request can resume there; anchors are
taken at the boundaries worth resuming from (`engine.kv.snapshot_policy`: prompt ends, reply ends, breakpoints,
server hints). Every page is exactly one of
  free      -- in the free list;
  held      -- referenced by running sequences (the part of their window table they still read) and by anchors;
               ``refs[page]`` counts both, and the page is freed when it reaches 0.
Anchors overlap (consecutive reply ends share all but one page), so an anchor's cost is the pages only it holds.
When the pool runs short, the anchor that goes is the first, in least-recently-used order (ordinary blocks' before
pinned or session-held ones', those superseded by a deeper anchor on the same unbranched path first), whose
eviction frees a page: an anchor whose pages others hold too costs nothing and is kept. Page ids only; the runner
owns the tensors.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.kv.blocks import CachedBlock

NO_PAGE = 0  # what a block table holds where a sequence has no window page: no query of it ever reads there


def first_window_block(num_tokens: int, window: int, block_size: int) -> int:
    """The first block a query at position ``num_tokens`` reads in a window layer (its window's first key,
    ``num_tokens - window + 1``, lies in it)."""
    return max(0, num_tokens - window + 1) // block_size


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
        self.anchors: OrderedDict[CachedBlock, None] = OrderedDict()  # least recently used first
        self.evictions = 0  # anchors dropped to make room

    # ---- queries ---------------------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def free_pages(self) -> list[int]:
        """The pages nobody holds: no query reads them until they are handed out again."""
        return list(self._free)

    def first_block(self, num_tokens: int) -> int:
        return first_window_block(num_tokens, self.window, self.block_size)

    def usable(self, node: CachedBlock) -> bool:
        return node.window_pages is not None

    # ---- pages -----------------------------------------------------------------------------------------------------
    def take(self) -> int | None:
        """A free page (its one reference is the caller's), evicting anchors if none is free; None when every page
        is held by running sequences or by anchors that cannot give one up alone."""
        if not self._free and not self._evict_one():
            return None
        page = self._free.pop()
        self.refs[page] = 1
        return page

    def ref(self, page: int) -> None:
        assert self.refs[page] > 0, "a free page is referenced"
        self.refs[page] += 1

    def unref(self, page: int) -> None:
        self.refs[page] -= 1
        assert self.refs[page] >= 0
        if self.refs[page] == 0:
            self._free.append(page)

    # ---- anchors ---------------------------------------------------------------------------------------------------
    def anchor(self, node: CachedBlock, first: int, pages: list[int]) -> bool:
        """Keep ``pages`` (the window pages of blocks ``first ..``, ending with ``node``'s block) for resuming at the
        end of ``node``'s block. False if the node has an anchor already (it is refreshed)."""
        if node.window_pages is not None:
            self.touch(node)
            return False
        for page in pages:
            self.ref(page)
        node.window_first, node.window_pages = first, tuple(pages)
        self.anchors[node] = None
        return True

    def touch(self, node: CachedBlock) -> None:
        self.anchors.move_to_end(node)

    def demote(self, node: CachedBlock) -> None:
        """Make the anchor the next to go (a deeper one on the same path serves its purpose better)."""
        self.anchors.move_to_end(node, last=False)

    def drop(self, node: CachedBlock) -> None:
        """Release the node's anchor (the node left the tree, or a newer reply end replaces it)."""
        del self.anchors[node]
        pages, node.window_pages = node.window_pages, None
        for page in pages:
            self.unref(page)

    def _evict_one(self) -> bool:
        """Drop the first anchor in eviction order whose pages free at least one page; False if none does."""
        order = sorted(enumerate(self.anchors), key=lambda item: (item[1].retained, item[0]))
        for _, node in order:
            if any(self.refs[page] == 1 for page in node.window_pages):
                if self.on_drop is not None:
                    self.on_drop(node)
                self.drop(node)
                self.evictions += 1
                return True
        return False

    # ---- invariants ------------------------------------------------------------------------------------------------
    def check_invariants(self, running: list[list[int]]) -> None:
        """``running``: the pages each live sequence holds (its window table's live part). Every page is free or
        held, and its reference count is its holders'."""
        holders = [0] * self.num_pages
        for pages in running:
            for page in pages:
                holders[page] += 1
        for node in self.anchors:
            assert node.in_tree and node.window_pages is not None, "an anchor's node left the tree or forgot it"
            for page in node.window_pages:
                holders[page] += 1
        assert holders == self.refs, "a window page's reference count is not its holders'"
        free = set(self._free)
        assert len(free) == len(self._free), "a window page is free twice"
        assert free == {p for p in range(self.num_pages) if not self.refs[p]}, "a window page is lost or both free " \
                                                                              "and held"
