"""KV manager: exact prefix hits, salts, eviction order, and invariants under random operation sequences."""
from __future__ import annotations

import random

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.kv_cache import KVCacheManager, hash_block


def test_hash_is_chained_and_salted():
    a = hash_block(None, [1, 2, 3, 4], b"m\0")
    assert len(a) == 16
    assert hash_block(None, [1, 2, 3, 4], b"m\0salt") != a
    assert hash_block(a, [5, 6, 7, 8]) != hash_block(hash_block(None, [9, 2, 3, 4], b"m\0"), [5, 6, 7, 8])


def test_shared_prefix_hits_block_aligned_length():
    kv = KVCacheManager(num_pages=32, block_size=4)
    first = list(range(100, 114))  # 14 tokens: 3 full blocks
    assert kv.admit("a", first, len(first)) == 0
    kv.commit("a", first, len(first))
    second = first[:10] + [7, 7, 7, 7, 7]  # shares 10 tokens = 2 full blocks + 2
    assert kv.admit("b", second, len(second)) == 8
    assert kv.block_table("b")[:2] == kv.block_table("a")[:2]
    kv.check_invariants()


def test_fully_cached_prompt_recomputes_its_last_block():
    kv = KVCacheManager(num_pages=16, block_size=4)
    prompt = list(range(12))
    kv.admit("a", prompt, 12)
    kv.commit("a", prompt, 12)
    kv.free("a")
    assert kv.admit("b", prompt, 12) == 8  # never all 12: the last token must be computed to sample from
    kv.check_invariants()


def test_different_salt_never_hits():
    kv = KVCacheManager(num_pages=16, block_size=4)
    prompt = list(range(9))
    kv.admit("a", prompt, 9, cache_salt="tenant-a")
    kv.commit("a", prompt, 9)
    assert kv.admit("b", prompt, 9, cache_salt="tenant-b") == 0
    assert kv.admit("c", prompt, 9, cache_salt="tenant-a") == 8


def test_lru_evicts_least_recent_leaf_and_never_in_use_pages():
    kv = KVCacheManager(num_pages=6, block_size=2)
    for name, base in (("a", 0), ("b", 100)):
        toks = [base + i for i in range(5)]  # 2 full blocks + 1
        kv.admit(name, toks, 5)
        kv.commit(name, toks, 5)
    kv.free("a")  # a's two blocks become evictable; b still holds its pages
    assert kv.num_free_pages == 3  # the pool was full: a's private page + a's 2 cached blocks
    assert kv.admit("c", [50 + i for i in range(6)], 6) == 0  # needs 3 pages: takes a's private and cached pages
    assert kv.stats.evictions == 2
    assert kv.num_cached_tokens([0, 1, 2, 3, 9]) == 0
    assert kv.num_cached_tokens([100, 101, 102, 103, 9]) == 4  # b's blocks were never touched
    kv.check_invariants()


def test_fifo_evicts_the_oldest_cached_block_even_if_recently_used():
    for policy, survivor in (("lru", "a"), ("fifo", "b")):
        kv = KVCacheManager(num_pages=4, block_size=2, eviction_policy=policy)
        a, b = [1, 2, 9], [3, 4, 9]
        for name, toks in (("a", a), ("b", b)):  # a is cached first
            kv.admit(name, toks, 3)
            kv.commit(name, toks, 3)
            kv.free(name)
        kv.admit("a2", a, 3)  # touch a again: most recently used, but still the oldest cached
        kv.free("a2")
        kv.admit("c", [5, 6, 7, 8, 9], 5)  # 3 pages: 2 free + one eviction
        assert kv.stats.evictions == 1
        assert kv.num_cached_tokens(a if survivor == "a" else b) == 2, policy
        assert kv.num_cached_tokens(b if survivor == "a" else a) == 0, policy
        kv.check_invariants()


def test_admit_without_pages_changes_nothing():
    kv = KVCacheManager(num_pages=3, block_size=4)
    assert kv.admit("a", list(range(20)), 20) is None
    assert kv.num_free_pages == 3 and not kv.seqs
    kv.check_invariants()


def test_identical_blocks_computed_twice_share_one_page():
    kv = KVCacheManager(num_pages=16, block_size=4)
    prompt = list(range(9))
    kv.admit("a", prompt, 9)
    kv.admit("b", prompt, 9)  # admitted before a's blocks were committed: no hit
    kv.commit("a", prompt, 9)
    kv.commit("b", prompt, 9)
    assert kv.block_table("a")[:2] == kv.block_table("b")[:2]
    kv.check_invariants()


def test_fork_shares_blocks_and_copies_private_pages():
    kv = KVCacheManager(num_pages=16, block_size=4)
    prompt = list(range(10))
    kv.admit("a", prompt, 10)
    kv.commit("a", prompt, 10)
    copies = kv.fork("a", "a2")
    assert kv.block_table("a2")[:2] == kv.block_table("a")[:2]
    assert copies == [(kv.block_table("a")[2], kv.block_table("a2")[2])]
    kv.check_invariants()


class KVMachine(RuleBasedStateMachine):
    """Random admit / extend / fork / free / evict sequences; the invariants must hold after every step."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(num_pages=24, block_size=4, model_id="m", eviction_policy=self.policy)
        self.tokens: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}
        self.next_id = 0
        self.rng = random.Random(0)

    def _new_tokens(self, n: int) -> list[int]:
        return [self.rng.choice((1, 2, 3)) for _ in range(n)]  # tiny alphabet: many shared prefixes

    @rule(length=st.integers(1, 30), shared=st.integers(0, 30), salt=st.sampled_from([None, "x"]))
    def admit(self, length: int, shared: int, salt: str | None) -> None:
        base = next(iter(self.tokens.values()), [])[:shared]
        toks = (base + self._new_tokens(length))[: max(length, 1)]
        sid = self.next_id
        self.next_id += 1
        cached = self.kv.admit(sid, toks, len(toks), cache_salt=salt)
        if cached is not None:
            assert cached % 4 == 0 and cached < len(toks)
            assert toks[:cached] == toks[:cached]
            self.tokens[sid] = toks
            self.computed[sid] = cached
            self.kv.commit(sid, toks, len(toks))
            self.computed[sid] = len(toks)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), n=st.integers(1, 9))
    def extend(self, data, n: int) -> None:
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        toks = self.tokens[sid] + self._new_tokens(n)
        if self.kv.allocate(sid, len(toks)):
            self.tokens[sid] = toks
            self.kv.commit(sid, toks, len(toks))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data) -> None:
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        new = self.next_id
        self.next_id += 1
        if self.kv.fork(sid, new) is not None:
            self.tokens[new] = list(self.tokens[sid])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data) -> None:
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.kv.free(sid)
        del self.tokens[sid]

    @rule(n=st.integers(1, 10))
    def evict(self, n: int) -> None:
        before = self.kv.num_free_pages
        self.kv.evict(n)
        assert self.kv.num_free_pages == before  # eviction moves pages from cached to free, never from in-use

    @invariant()
    def invariants_hold(self) -> None:
        self.kv.check_invariants()
        for sid, toks in self.tokens.items():
            assert len(self.kv.block_table(sid)) >= self.kv.pages_needed(len(toks))


class LRUMachine(KVMachine):
    policy = "lru"


class FIFOMachine(KVMachine):
    policy = "fifo"


TestLRUMachine = LRUMachine.TestCase
TestLRUMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestFIFOMachine = FIFOMachine.TestCase
TestFIFOMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


@pytest.mark.parametrize("seed", range(3))
def test_every_cached_block_matches_the_tokens_that_made_it(seed):
    rng = random.Random(seed)
    kv = KVCacheManager(num_pages=40, block_size=4)
    written: dict[int, tuple[int, ...]] = {}  # page -> the tokens whose K/V the "model" wrote there
    for sid in range(60):
        toks = [rng.randint(0, 2) for _ in range(rng.randint(2, 24))]
        cached = kv.admit(sid, toks, len(toks))
        if cached is None:
            kv.evict(40)
            continue
        table = kv.block_table(sid)
        for i in range(cached // 4):  # hits must point at pages holding exactly these tokens
            assert written[table[i]] == tuple(toks[i * 4 : (i + 1) * 4])
        for i in range(cached // 4, len(table)):
            written[table[i]] = tuple(toks[i * 4 : (i + 1) * 4])
        kv.commit(sid, toks, len(toks))
        if rng.random() < 0.7:
            kv.free(sid)
        kv.check_invariants()
