"""The KV manager of a sliding-window model (full-attention pages + the window group, engine/kv/window_pool.py):
random admissions, steps, retained windows, preemptions, frees and evictions keep every invariant (each window page
free, cached or held, its reference count its holders'; every anchor's pages those its window's blocks name), and, following
what the "model" writes into the pages, every step's queries read their own sequence's K/V in every window page they
read, and a hit resumes on exactly the window it needs: the pages of (P - window, P) hold the prompt's K/V there.
With host and disk tiers, retained windows leaving the device travel with their blocks and come back on a hit
(following every copy the manager asks for, and the KV events a router would read)."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

import pytest

from engine.kv.block_hashing import BlockHasher
from engine.kv.manager import KVCacheManager
from engine.kv.window_pool import first_window_block
from tests.kv.kv_model import BlockContents, EventReplay

BS = 4
PROMPTS = [[1, 2, 3, 4] * k + [9, k] for k in range(1, 7)] + [[5, 6, 7, 8] * 4 + [1, 2], [3] * 30]


class WindowModel:
    """Drives a window-group KV manager as the scheduler does (slide, allocate, commit, retain) and follows the
    contents of the window pages: the tokens up to the end of the block each page was written for."""

    def __init__(self, num_blocks: int, window_pages: int, window: int, **tiers) -> None:
        """``tiers``: the KV manager's host and disk tiers (blocks and window rows), with its events recorded."""
        self.kv = KVCacheManager(num_blocks, BS, window_blocks=window_pages, window=window, record_events=bool(tiers),
                                 **tiers)
        self.window = window
        self.hasher = BlockHasher(BS, "m")
        self.live: dict[str, tuple[list[int], list]] = {}  # seq -> (tokens, hashes)
        self.computed: dict[str, int] = {}
        self.blocks = BlockContents()  # what the runner's copies make of every tier
        self.content = self.blocks.window  # the tokens up to the end of the block each window page was written for
        self.events = EventReplay(BS)
        self.counter = 0

    def copy(self) -> None:
        """Run the copies between tiers the manager asked for (before the step's forward), and read its events."""
        self.blocks.apply(self.kv.take_transfers())
        self.events.apply(self.kv.take_events())

    def check(self) -> None:
        self.copy()
        self.kv.check_invariants()
        self.blocks.check(self.kv)
        if self.kv.tiers.enabled:
            self.events.check(self.kv)

    def admit(self, tokens: list[int]) -> str | None:
        hashes = self.hasher.hashes(tokens, None)
        self.counter += 1
        seq = f"s{self.counter}"
        cached = self.kv.admit(seq, hashes, tokens, 2 * BS)
        if cached is None:
            return None
        self.copy()
        table = self.kv.window_table(seq)
        for i in range(first_window_block(cached, self.window, BS), cached // BS):  # the window a hit resumes on
            assert self.content[table[i]] == tuple(tokens[: (i + 1) * BS]), "a hit's window holds other K/V"
            assert self.kv.window.owner[table[i]] in (self.kv.by_hash[hashes[i]], None), \
                "a hit reads a page another block names"  # (None: a tier's window copied beside a cached page)
        self.live[seq] = (tokens, hashes)
        self.computed[seq] = cached
        self._compute(seq, 0)
        return seq

    def step(self, seq: str, n: int) -> bool:
        """Compute ``n`` more tokens of the sequence (as far as it has tokens); False if no pages were left."""
        tokens, hashes = self.live[seq]
        start = self.computed[seq]
        n = min(n, len(tokens) - start)
        if n <= 0:
            return True
        self.kv.slide(seq, start)
        if self.kv.allocate(seq, start + n) is None:
            return False
        self.copy()
        self._compute(seq, n)
        self.kv.commit(seq, hashes, tokens, start + n)
        return True

    def _compute(self, seq: str, n: int) -> None:
        """The step's queries read the window pages of their context (checked), then write their own."""
        tokens, _ = self.live[seq]
        start, table = self.computed[seq], self.kv.window_table(seq)
        for i in range(first_window_block(start, self.window, BS), -(-start // BS)):
            assert self.content.get(table[i]) == tuple(tokens[: min(start, (i + 1) * BS)]), \
                "a query reads a window page that holds other K/V"
        end = start + n
        for i in range(start // BS, -(-end // BS)):
            self.content[table[i]] = tuple(tokens[: min(end, (i + 1) * BS)])
            self.blocks.device[self.kv.block_table(seq)[i]] = tuple(tokens[i * BS : min(end, (i + 1) * BS)])
        self.computed[seq] = end

    def retain(self, seq: str, blocks: int, reply: bool) -> None:
        boundary = min(blocks * BS, self.computed[seq] // BS * BS)
        self.kv.keep_window(seq, boundary, replaces_reply=reply)

    def free(self, seq: str, preempt: bool) -> None:
        if preempt:  # as the scheduler preempts: the window at its last boundary stays for its re-admission
            self.kv.keep_window(seq, self.computed[seq] // BS * BS, replaces_reply=True)
        self.kv.free(seq)
        del self.live[seq], self.computed[seq]


ops = st.lists(st.tuples(st.sampled_from(["admit", "step", "retain", "free", "preempt", "evict"]),
                         st.integers(0, len(PROMPTS) - 1), st.integers(1, 9)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops, st.sampled_from([(5, 18), (8, 24), (13, 40)]))
def test_random_operations_keep_the_invariants_and_the_windows_contents(script, sizes):
    window, pages = sizes
    run(WindowModel(40, pages, window), script)


@settings(max_examples=100, deadline=None)
@given(ops, st.sampled_from([(5, 18, 4, 1, 24, 6), (8, 24, 30, 8, 60, 20), (13, 40, 6, 2, 10, 2)]))
def test_random_operations_with_host_and_disk_tiers_keep_the_invariants_and_the_windows_contents(script, sizes):
    """The same, a small device pool over host and disk tiers: each step's queries, each hit's window (restored
    from a tier or not) and every tier's blocks and windows hold the K/V they are indexed under; the tiers keep no
    block without a window at or below it; the events tell a router exactly what each tier holds."""
    window, pages, host, host_windows, disk, disk_windows = sizes
    run(WindowModel(16, pages, window, host_blocks=host, host_states=host_windows, disk_blocks=disk,
                    disk_states=disk_windows), script)


def run(model: WindowModel, script: list[tuple[str, int, int]]) -> None:
    for op, which, n in script:
        live = sorted(model.live)
        if op == "admit":
            model.admit(PROMPTS[which])
        elif op == "step" and live:
            model.step(live[which % len(live)], n)
        elif op == "retain" and live:
            model.retain(live[which % len(live)], n, reply=n % 2 == 0)
        elif op in ("free", "preempt") and live:
            model.free(live[which % len(live)], preempt=op == "preempt")
        elif op == "evict":
            model.kv.evict(n)
        model.check()
        model.kv.take_window_blocks()


def test_a_running_sequence_holds_only_its_window():
    """A 30-token sequence computed a token at a time with a 5-token window in 4-token blocks: never more than the
    blocks its window and its last boundary's window touch (3), and every page back when it ends."""
    model = WindowModel(20, 6, 5)
    seq = model.admit(PROMPTS[-1][:1])
    model.live[seq] = (PROMPTS[-1], model.hasher.hashes(PROMPTS[-1], None))
    held = []
    while model.computed[seq] < 30:
        assert model.step(seq, 1)
        held.append(model.kv.window.num_pages - model.kv.window.num_free)
        model.kv.check_invariants()
    assert max(held) <= 3 and len(model.kv.window_table(seq)) == 8
    model.free(seq, preempt=False)
    assert model.kv.window.num_free == 6


def test_a_hit_ends_where_its_windows_pages_are_and_retained_windows_outlive_cached_pages():
    """An 18-token prompt (5-token window, 4-token blocks) with windows retained at 8 and 16 tokens: its other
    pages stay cached, so a request sharing 13 tokens resumes at 12 as well as one sharing 17 at 16. Once another
    sequence has reused every free and cached page, the retained windows are still there: 13 shared tokens now
    resume at 8, 17 still at 16."""
    model = WindowModel(40, 12, 5)
    seq = model.admit(PROMPTS[3])
    assert model.step(seq, 18)
    model.retain(seq, 2, reply=False)
    model.retain(seq, 4, reply=False)
    model.free(seq, preempt=False)
    hashes = model.hasher.hashes(PROMPTS[3], None)
    assert model.kv.num_cached_tokens(hashes[:4], 17) == 16
    assert model.kv.num_cached_tokens(hashes[:3], 13) == 12
    other = model.admit([7] * 45)
    assert model.step(other, 40)  # 10 pages: the 8 free ones, then the 2 cached ones
    assert model.kv.num_cached_tokens(hashes[:4], 17) == 16
    assert model.kv.num_cached_tokens(hashes[:3], 13) == 8
    model.kv.check_invariants()


def test_pages_run_short_an_anchor_that_frees_nothing_is_kept():
    """With the pool full, the oldest anchor whose pages only it holds goes; one whose pages a running sequence
    holds too costs nothing and stays."""
    model = WindowModel(40, 6, 5)
    a = model.admit(PROMPTS[0])  # 6 tokens
    assert model.step(a, 6)
    model.retain(a, 1, reply=False)  # anchor at 4: block 0's page
    b = model.admit([7] * 9)
    assert model.step(b, 8)
    model.retain(b, 2, reply=False)  # anchor at 8: blocks 1 (and 0 outside the window)
    model.free(b, preempt=False)
    old = model.kv.window.evictions
    c = model.admit([8] * 30)  # a 16-token chunk: 4 pages at once, with 3 free
    assert model.step(c, 16)
    model.kv.check_invariants()
    assert model.kv.window.evictions == old + 1
    assert model.kv.by_hash[model.hasher.hashes([7] * 9, None)[1]].window_pages is None, "b's anchor went"
    anchor_a = model.kv.by_hash[model.hasher.hashes(PROMPTS[0], None)[0]]
    assert anchor_a.window_pages is not None, "a's anchor shares its page with a running a: it was kept"


def test_anchors_covering_each_others_pages_give_them_up_when_no_page_is_left():
    """Anchors at 8, 12 and 20 tokens of one sequence (13-token window, 6 pages) and the sequence itself hold every
    page, none an anchor's alone: each page has two holders. Dropping the anchors at 8 and 12 frees three, so the
    next block gets one (before, the check counted them, the pool found none to give up: an engine fault)."""
    model = WindowModel(40, 6, 13)
    seq = model.admit(PROMPTS[-1])
    assert model.step(seq, 12)
    model.retain(seq, 2, reply=False)
    model.retain(seq, 3, reply=False)
    assert model.step(seq, 8)
    model.retain(seq, 5, reply=False)
    assert model.step(seq, 4)
    model.check()
    assert model.kv.window.num_free == 0 and len(model.kv.window.anchors) == 3
    assert model.step(seq, 4)  # its window slides past block 2: the pages of blocks 0-2 are the anchors' alone
    model.check()
    assert model.kv.window.evictions == 2 and len(model.kv.window.anchors) == 1


def test_kv_events_say_which_blocks_have_a_retained_window():
    """A window model's BlockStored events list the blocks a hit can resume at ("state_snapshots", as a hybrid's
    snapshots); dropping a retained window is announced again without it."""
    from engine.kv.events import BlockStored

    model = WindowModel(40, 12, 5)
    model.kv = KVCacheManager(40, BS, window_blocks=12, window=5, record_events=True)
    seq = model.admit(PROMPTS[3])
    assert model.step(seq, 18)
    model.retain(seq, 4, reply=False)
    hashes = model.hasher.hashes(PROMPTS[3], None)
    stored = [e for e in model.kv.take_events() if isinstance(e, BlockStored)]
    assert any(hashes[3] in e.block_hashes and hashes[3] in e.snapshot_hashes for e in stored)
    assert not any(hashes[2] in (e.snapshot_hashes or []) for e in stored)
    model.free(seq, preempt=False)
    model.kv._drop_anchor(model.kv.by_hash[hashes[3]])
    last = [e for e in model.kv.take_events() if isinstance(e, BlockStored)][-1]
    assert last.block_hashes == [hashes[3]] and last.snapshot_hashes == []


def test_a_pinned_blocks_retained_window_goes_after_ordinary_ones():
    """Pages short: the retained window of an ordinary block goes before that of a pinned block (a breakpoint), even
    when the pinned one is older."""
    model = WindowModel(40, 8, 5)
    a = model.admit(PROMPTS[0])  # 6 tokens: a window at 4 (block 0)
    assert model.step(a, 6)
    model.retain(a, 1, reply=False)
    pinned = model.kv.by_hash[model.hasher.hashes(PROMPTS[0], None)[0]]
    model.kv.retain_chain([pinned.block_hash], 300.0, pin=True)
    model.free(a, preempt=False)
    b = model.admit([7] * 9)  # a window at 8 (block 1)
    assert model.step(b, 8)
    model.retain(b, 2, reply=False)
    model.free(b, preempt=False)
    c = model.admit([8] * 40)
    assert model.step(c, 28)  # 7 pages of 8: one retained window has to go
    model.kv.check_invariants()
    assert pinned.window_pages is not None
    assert model.kv.by_hash[model.hasher.hashes([7] * 9, None)[1]].window_pages is None


@pytest.mark.parametrize("disk", [False, True])
def test_a_retained_window_evicted_with_its_block_comes_back_from_a_lower_tier(disk):
    """A 17-token prompt (5-token window, 4-token blocks) retained at 16, then pushed out of an 8-block device pool
    by another sequence: its blocks and its window go to the host (and disk) tier, and the prompt resumes at 16 again
    from there (from disk when the host pool is too small to keep them), its window's page holding its K/V. Without
    tiers it is recomputed."""
    tiers = dict(host_blocks=2, host_states=1, disk_blocks=8, disk_states=2) if disk else dict(host_blocks=8,
                                                                                                host_states=2)
    for model in (WindowModel(8, 8, 5, **tiers), WindowModel(8, 8, 5)):
        prompt = PROMPTS[3][:17]
        seq = model.admit(prompt)
        assert model.step(seq, 17)
        model.retain(seq, 4, reply=False)
        model.free(seq, preempt=False)
        other = model.admit([7] * 30)
        assert model.step(other, 30)
        model.free(other, preempt=False)
        model.check()
        hashes = model.hasher.hashes(prompt, None)
        assert hashes[0] not in model.kv.by_hash, "the prompt left the device"
        again = model.admit(prompt)  # checks the window it resumes on
        model.check()
        cached = model.computed[again]
        if not model.kv.tiers.enabled:
            assert cached == 0
            continue
        assert cached == 16
        hits = model.kv.stats.disk_hits if disk else model.kv.stats.host_hits
        assert hits == 16, "every block came from the tier"
