"""KV manager beyond LRU: pins and TTLs, session holds, the retention cap, host and disk tiers, and the KV events --
unit cases, then a state machine that checks the invariants, the blocks' contents (through the copy instructions)
and the event-replayed tier sets after every operation."""
from __future__ import annotations

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.kv.manager import KVCacheManager
from engine.kv.events import AllBlocksCleared
from engine.outputs import TransferKind
from engine.retention import CachePin, Retention
from tests.kv.kv_model import BlockContents, EventReplay
from tests.kv.test_manager import cached, hashes


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(num_blocks: int, host: int = 0, disk: int = 0, fraction: float = 0.5, clock: Clock | None = None):
    clock = clock or Clock()
    kv = KVCacheManager(num_blocks, 4, max_retained_fraction=fraction, host_blocks=host, disk_blocks=disk,
                        record_events=True, clock=clock)
    return kv, clock


def run(kv: KVCacheManager, sid, toks: list[int], contents: BlockContents | None = None,
        retention: Retention | None = None, hold_s: float = 0.0) -> int | None:
    """Admit, compute, commit and free one sequence, applying its copies to ``contents``."""
    got = kv.admit(sid, hashes(toks), toks, len(toks), retention=retention)
    if got is None:
        return None
    if contents is not None:
        contents.apply(kv.take_transfers())
        contents.compute(kv, sid, toks)
    kv.commit(sid, hashes(toks), toks, len(toks))
    kv.free(sid, hold_s)
    return got


def seq(base: int, n: int) -> list[int]:
    return [base + i for i in range(n)]


def test_pinned_prefix_survives_pressure_that_evicts_everything_else():
    kv, _ = make(12)
    a = seq(0, 17)  # 4 full blocks + 1
    run(kv, "a", a, retention=Retention((CachePin(8, 300.0),)))  # pin the first 2 blocks
    run(kv, "b", seq(100, 40))  # needs 10 blocks: evicts a's unpinned blocks, then would take pinned ones last
    assert cached(kv, a) == 8
    assert kv.num_retained_blocks == 2
    kv.check_invariants()


def test_expired_pin_is_ordinary_lru_and_hits_refresh_it():
    kv, clock = make(12)
    a = seq(0, 9)
    run(kv, "a", a, retention=Retention((CachePin(8, 60.0),)))
    clock.now += 50
    run(kv, "a2", a)  # a hit refreshes the pin: 60 s from now
    clock.now += 50
    assert kv.num_retained_blocks == 2
    clock.now += 11
    assert kv.num_retained_blocks == 0  # expired: ordinary LRU again
    run(kv, "b", seq(100, 45))  # 12 blocks: everything goes
    assert cached(kv, a) == 0
    kv.check_invariants()


def test_retention_cap_refuses_past_the_fraction():
    kv, _ = make(10, fraction=0.3)  # at most 3 retained blocks
    run(kv, "a", seq(0, 21), retention=Retention((CachePin(20, 300.0),)))  # 5 blocks asked
    assert kv.num_retained_blocks == 3 and kv.queue.refused == 2
    kv.check_invariants()


def pinned_tokens(kv: KVCacheManager, sid, toks: list[int], retention: Retention) -> int:
    """Admit and compute one sequence; what its pins really retained (`num_pinned_tokens`), then free it."""
    assert kv.admit(sid, hashes(toks), toks, len(toks), retention=retention) is not None
    kv.commit(sid, hashes(toks), toks, len(toks))
    pinned = kv.num_pinned_tokens(sid)
    kv.free(sid)
    return pinned


def test_a_refused_pin_is_reported_as_not_retained():
    """A sequence's pins report what the cap let them keep: all of it, up to the first refused block, or nothing."""
    kv, _ = make(10, fraction=0.3)  # at most 3 retained blocks
    assert pinned_tokens(kv, "a", seq(0, 9), Retention((CachePin(8, 300.0),))) == 8  # 2 blocks: kept
    assert pinned_tokens(kv, "b", seq(100, 13), Retention((CachePin(12, 300.0),))) == 4  # 1 of 3 kept
    assert pinned_tokens(kv, "c", seq(200, 9), Retention((CachePin(8, 300.0),))) == 0  # the cap is full
    assert pinned_tokens(kv, "d", seq(0, 9), Retention((CachePin(8, 300.0),))) == 8  # a's blocks: retained already
    assert pinned_tokens(kv, "e", seq(300, 9), None) == 0
    kv.check_invariants()


def test_a_tenant_retains_at_most_its_share_of_the_cap():
    """Pins and session holds of one tenant together stop at its share; another tenant's still fit, and blocks
    retained without a tenant count against the cap alone."""
    clock = Clock()
    kv = KVCacheManager(40, 4, max_retained_fraction=0.5, max_retained_share_per_tenant=0.5, clock=clock)  # 20; 10
    pin_a = Retention((CachePin(32, 300.0),), tenant="a")
    assert pinned_tokens(kv, "a1", seq(0, 33), pin_a) == 32  # 8 blocks
    run(kv, "a2", seq(100, 17), retention=Retention(hold_after_finish_s=30.0, tenant="a"), hold_s=30.0)  # 4 held
    assert kv.queue.retained_by_tenant == {"a": 10} and kv.queue.refused == 2
    assert pinned_tokens(kv, "a3", seq(200, 9), Retention((CachePin(8, 300.0),), tenant="a")) == 0
    assert pinned_tokens(kv, "b1", seq(300, 33), Retention((CachePin(32, 300.0),), tenant="b")) == 32
    assert pinned_tokens(kv, "n1", seq(400, 9), Retention((CachePin(8, 300.0),))) == 8  # no tenant: the cap only
    assert kv.queue.retained_by_tenant == {"a": 10, "b": 8} and kv.num_retained_blocks == 20
    kv.check_invariants()
    clock.now += 60  # a's hold ends: its share is free again
    assert kv.num_retained_blocks == 18 and kv.queue.retained_by_tenant == {"a": 8, "b": 8}
    assert pinned_tokens(kv, "a4", seq(500, 9), Retention((CachePin(8, 300.0),), tenant="a")) == 8
    kv.check_invariants()


def test_hold_after_finish_keeps_a_session_until_it_expires():
    kv, clock = make(12)
    a, c, b = seq(0, 21), seq(200, 9), seq(100, 25)
    run(kv, "a", a, hold_s=30.0)  # 5 blocks, held
    run(kv, "c", c)  # 2 blocks, more recently used than a
    run(kv, "b", b)  # 7 blocks: 2 evictions, which LRU alone would take from a
    assert cached(kv, a) == 20 and cached(kv, c) == 0
    clock.now += 31
    run(kv, "d", seq(300, 41))  # a is ordinary again
    assert cached(kv, a) == 0
    kv.check_invariants()


def test_retain_chain_extends_and_ends_retention():
    kv, _ = make(12)
    a = seq(0, 9)
    run(kv, "a", a)
    assert kv.retain_chain(hashes(a), 30.0) == 2 and kv.num_retained_blocks == 2
    assert kv.retain_chain(hashes(a), 0) == 2 and kv.num_retained_blocks == 0


def test_evicted_blocks_go_to_host_and_come_back_as_hits():
    kv, _ = make(8, host=16)
    contents = BlockContents()
    a, b = seq(0, 17), seq(100, 29)
    run(kv, "a", a, contents)
    run(kv, "b", b, contents)  # evicts a's blocks into the host pool
    assert cached(kv, a) == 16  # the lookup sees the host tier too
    got = run(kv, "a2", a, contents)
    assert got == 16 and kv.stats.host_hits > 0
    contents.check(kv)
    kv.check_invariants()


def test_a_restore_never_reads_a_host_slot_its_own_evictions_reused():
    # Host pool of 2: restoring 2 blocks evicts device blocks whose offloads would push those very blocks out.
    kv, _ = make(6, host=2)
    contents = BlockContents()
    a = seq(0, 9)
    run(kv, "a", a, contents)
    run(kv, "b", seq(100, 21), contents)  # a's 2 blocks go to the host
    run(kv, "a2", a, contents)
    contents.check(kv)
    kv.check_invariants()


def test_disk_tier_is_written_through_and_restored():
    kv, _ = make(6, host=2, disk=32)
    contents = BlockContents()
    a = seq(0, 9)
    run(kv, "a", a, contents)
    for i in range(3):  # push a out of the device and then out of the host
        run(kv, f"x{i}", seq(1000 * (i + 1), 21), contents)
    assert all(h not in kv.tiers.host for h in hashes(a)) and all(h in kv.tiers.disk for h in hashes(a))
    assert run(kv, "a2", a, contents) == 8 and kv.stats.disk_hits == 8
    contents.check(kv)
    kv.check_invariants()


def test_reset_clears_every_tier_with_one_event():
    kv, _ = make(8, host=8, disk=8)
    contents = BlockContents()
    run(kv, "a", seq(0, 17), contents)
    run(kv, "b", seq(100, 29), contents)
    kv.take_events()
    kv.reset_prefix_cache()
    contents.apply(kv.take_transfers())
    assert kv.take_events() == [AllBlocksCleared()]
    assert not kv.by_hash and not len(kv.tiers.host) and not len(kv.tiers.disk) and not contents.disk
    kv.check_invariants()


def test_persist_writes_the_device_tree_through():
    kv, _ = make(8, host=4, disk=16)
    contents = BlockContents()
    run(kv, "a", seq(0, 17), contents)
    kv.persist()
    transfers = kv.take_transfers()
    assert sum(t.kind is TransferKind.DISK_WRITE for t in transfers) == 4
    contents.apply(transfers)
    contents.check(kv)


class TieredKVMachine(RuleBasedStateMachine):
    """Random admit / compute / extend / free (with holds) / evict / pin / clock / reset sequences over a small pool
    with host and disk tiers. After every step: the invariants hold, every cached block in every tier holds its
    tokens (following the copy instructions), and replaying the events gives each tier's exact block set."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.kv = KVCacheManager(20, 4, max_retained_fraction=0.4, max_retained_share_per_tenant=0.5, host_blocks=6,
                                 disk_blocks=10, record_events=True, clock=self.clock)
        self.contents = BlockContents()
        self.replay = EventReplay()
        self.tokens: dict[int, list[int]] = {}
        self.next_id = 0

    def _sync(self) -> None:
        self.contents.apply(self.kv.take_transfers())
        self.replay.apply(self.kv.take_events())

    @rule(new=st.lists(st.sampled_from((1, 2, 3)), min_size=1, max_size=24), shared=st.integers(0, 24),
          pin=st.one_of(st.none(), st.integers(0, 24)), ttl=st.sampled_from((5.0, 60.0)),
          tenant=st.sampled_from((None, "a", "b")))
    def admit(self, new: list[int], shared: int, pin: int | None, ttl: float, tenant: str | None) -> None:
        base = next(iter(self.tokens.values()), [])[:shared]
        toks = base + new
        sid, self.next_id = self.next_id, self.next_id + 1
        retention = Retention((CachePin(pin, ttl),), tenant=tenant) if pin is not None else None
        got = self.kv.admit(sid, hashes(toks), toks, len(toks), retention=retention)
        self._sync()
        if got is not None:
            for i, node in enumerate(self.kv.seqs[sid].nodes):  # hits hold exactly this sequence's tokens
                assert node.token_ids == tuple(toks[i * 4 : (i + 1) * 4])
            self.contents.compute(self.kv, sid, toks)  # the forward writes every block but the cached ones: same
            self.tokens[sid] = toks

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def commit(self, data) -> None:
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.kv.commit(sid, hashes(self.tokens[sid]), self.tokens[sid], len(self.tokens[sid]))
        self._sync()

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), new=st.lists(st.sampled_from((1, 2, 3)), min_size=1, max_size=6))
    def extend(self, data, new: list[int]) -> None:
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        toks = self.tokens[sid] + new
        if self.kv.allocate(sid, len(toks)) is not None:
            self._sync()
            self.tokens[sid] = toks
            self.contents.compute(self.kv, sid, toks)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), hold=st.sampled_from((0.0, 0.0, 10.0)))
    def free(self, data, hold: float) -> None:
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.kv.free(sid, hold)
        del self.tokens[sid]

    @rule(n=st.integers(1, 8))
    def evict(self, n: int) -> None:
        self.kv.evict(n)
        self._sync()

    @rule(seconds=st.sampled_from((1.0, 7.0, 30.0)))
    def time_passes(self, seconds: float) -> None:
        self.clock.now += seconds

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), seconds=st.sampled_from((0.0, 20.0)))
    def retain(self, data, seconds: float) -> None:
        toks = self.tokens[data.draw(st.sampled_from(sorted(self.tokens)))]
        self.kv.retain_chain(hashes(toks), seconds, pin=True)

    @rule()
    def reset(self) -> None:
        self.kv.reset_prefix_cache()
        self._sync()

    @invariant()
    def consistent(self) -> None:
        self.kv.check_invariants()
        self.contents.check(self.kv)
        self.replay.check(self.kv)


TestTieredKVMachine = pytest.mark.slow(TieredKVMachine.TestCase)  # hypothesis runs many steps
TestTieredKVMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_what_the_inspector_reads_tier_hits_eviction_causes_where_cached_and_prefixes():
    kv, clock = make(6, host=2, disk=32)
    a = seq(0, 9)  # 2 full blocks + 1
    run(kv, "a", a, retention=Retention((CachePin(4, 300.0),)))  # block 0 pinned
    assert kv.where_cached(hashes(a)) == ["retained", "device"]
    [prefix] = kv.cached_prefixes(5)
    assert prefix.block_hashes == tuple(hashes(a)) and prefix.num_retained == 1 and prefix.num_referenced == 0
    assert prefix.retained_until == clock.now + 300.0
    for i in range(3):  # a leaves the device (its pinned block last), then the 2-block host pool
        run(kv, f"x{i}", seq(1000 * (i + 1), 21))
    assert kv.stats.retained_evictions == 1 and kv.stats.evictions > 2 and kv.tiers.host_drops > 0
    assert kv.where_cached(hashes(a)) == ["disk", "disk"]
    kv.admit("a2", hashes(a), a, len(a))
    assert (kv.seqs["a2"].host_hits, kv.seqs["a2"].disk_hits) == (0, 8)
    [held] = [p for p in kv.cached_prefixes(5) if p.block_hashes == tuple(hashes(a))]
    assert held.num_referenced == 2  # a2 holds the restored blocks
    kv.free("a2")
    kv.reset_prefix_cache()
    assert kv.stats.reset_evictions > 0 and kv.cached_prefixes(5) == []
    kv.check_invariants()


def test_snapshot_points_are_where_a_hybrid_chain_resumes():
    kv = KVCacheManager(16, 4, state_rows=4)
    a = seq(100, 13)  # 3 full blocks
    kv.admit("a", hashes(a), a, len(a))
    assert kv.take_snapshot("a", 8)  # the recurrent state at the end of block 1
    kv.commit("a", hashes(a), a, len(a))
    kv.free("a")
    assert kv.snapshot_points(hashes(a)) == [8]
    assert make(8)[0].snapshot_points(hashes(a)) == []  # a dense model's manager: no snapshots
