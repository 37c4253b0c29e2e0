"""KV manager: exact prefix hits, salts, eviction order, append-only tables, and invariants under random operation
sequences."""
from __future__ import annotations

import random

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.kv.block_hashing import BlockHasher, hash_block
from engine.kv.manager import KVCacheManager


def hashes(toks: list[int], block_size: int = 4, salt: str | None = None) -> list[bytes]:
    return BlockHasher(block_size, "m").hashes(toks, salt)


def admit(kv: KVCacheManager, sid, toks: list[int], salt: str | None = None, resumed: bool = False) -> int | None:
    return kv.admit(sid, hashes(toks, kv.block_size, salt), toks, len(toks), resumed)


def commit(kv: KVCacheManager, sid, toks: list[int], salt: str | None = None) -> None:
    kv.commit(sid, hashes(toks, kv.block_size, salt), toks, len(toks))


def cached(kv: KVCacheManager, toks: list[int], salt: str | None = None) -> int:
    return kv.num_cached_tokens(hashes(toks, kv.block_size, salt), len(toks))


def test_hash_is_chained_and_salted():
    a = hash_block(None, [1, 2, 3, 4], b"m\0")
    assert len(a) == 16
    assert hash_block(None, [1, 2, 3, 4], b"m\0salt") != a
    assert hash_block(a, [5, 6, 7, 8]) != hash_block(hash_block(None, [9, 2, 3, 4], b"m\0"), [5, 6, 7, 8])


def test_hasher_extends_incrementally():
    hasher = BlockHasher(4, "m")
    toks = list(range(11))
    grown: list[bytes] = []
    for n in range(len(toks) + 1):  # one token at a time, as decode appends them
        hasher.extend(grown, toks[:n], "s")
    assert grown == hasher.hashes(toks, "s") and len(grown) == 2
    assert hasher.hashes(toks, None) != grown  # the salt is part of block 0's identity


def test_shared_prefix_hits_block_aligned_length():
    kv = KVCacheManager(num_blocks=32, block_size=4)
    first = list(range(100, 114))  # 14 tokens: 3 full blocks
    assert admit(kv, "a", first) == 0
    commit(kv, "a", first)
    second = first[:10] + [7, 7, 7, 7, 7]  # shares 10 tokens = 2 full blocks + 2
    assert cached(kv, second) == 8
    assert admit(kv, "b", second) == 8
    assert kv.block_table("b")[:2] == kv.block_table("a")[:2]
    assert kv.stats.queries == len(first) + len(second) and kv.stats.hits == 8
    kv.check_invariants()


def test_fully_cached_prompt_recomputes_its_last_block():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    prompt = list(range(12))
    admit(kv, "a", prompt)
    commit(kv, "a", prompt)
    kv.free("a")
    assert admit(kv, "b", prompt) == 8  # never all 12: the last token must be computed to sample from
    kv.check_invariants()


def test_different_salt_never_hits():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    prompt = list(range(9))
    admit(kv, "a", prompt, salt="tenant-a")
    commit(kv, "a", prompt, salt="tenant-a")
    assert admit(kv, "b", prompt, salt="tenant-b") == 0
    assert admit(kv, "c", prompt, salt="tenant-a") == 8


def test_resumed_lookups_are_counted_apart():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    prompt = list(range(9))
    admit(kv, "a", prompt)
    commit(kv, "a", prompt)
    kv.free("a")  # as a preemption does
    assert admit(kv, "a", prompt, resumed=True) == 8
    stats = kv.stats
    assert (stats.queries, stats.hits, stats.preempted_queries, stats.preempted_hits) == (9, 0, 9, 8)


def test_lru_evicts_least_recent_leaf_and_never_in_use_blocks():
    kv = KVCacheManager(num_blocks=6, block_size=2)
    for name, base in (("a", 0), ("b", 100)):
        toks = [base + i for i in range(5)]  # 2 full blocks + 1
        admit(kv, name, toks)
        commit(kv, name, toks)
    kv.free("a")  # a's two blocks become evictable; b still holds its blocks
    assert kv.num_free_blocks == 3  # the pool was full: a's private block + a's 2 cached blocks
    assert admit(kv, "c", [50 + i for i in range(6)]) == 0  # needs 3 blocks: a's private and cached blocks
    assert kv.stats.evictions == 2
    assert cached(kv, [0, 1, 2, 3, 9]) == 0
    assert cached(kv, [100, 101, 102, 103, 9]) == 4  # b's blocks were never touched
    kv.check_invariants()


def test_fifo_evicts_the_oldest_cached_block_even_if_recently_used():
    for policy, survivor in (("lru", "a"), ("fifo", "b")):
        kv = KVCacheManager(num_blocks=4, block_size=2, eviction_policy=policy)
        a, b = [1, 2, 9], [3, 4, 9]
        for name, toks in (("a", a), ("b", b)):  # a is cached first
            admit(kv, name, toks)
            commit(kv, name, toks)
            kv.free(name)
        admit(kv, "a2", a)  # touch a again: most recently used, but still the oldest cached
        kv.free("a2")
        admit(kv, "c", [5, 6, 7, 8, 9])  # 3 blocks: 2 free + one eviction
        assert kv.stats.evictions == 1
        assert cached(kv, a if survivor == "a" else b) == 2, policy
        assert cached(kv, b if survivor == "a" else a) == 0, policy
        kv.check_invariants()


def test_admit_without_blocks_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    assert admit(kv, "a", list(range(20))) is None
    assert kv.num_free_blocks == 3 and not kv.seqs and kv.stats.queries == 0
    kv.check_invariants()


def test_admit_counts_its_own_hits_as_no_longer_evictable():
    # Both cached blocks are unreferenced: a request that hits them and needs 2 more blocks has only 2 free ones.
    kv = KVCacheManager(num_blocks=4, block_size=2)
    admit(kv, "a", [1, 2, 3, 4, 5])
    commit(kv, "a", [1, 2, 3, 4, 5])
    kv.free("a")
    assert admit(kv, "b", [1, 2, 3, 4, 5, 6, 7, 8, 9]) is None  # hits 2 blocks, needs 3 more of the 2 left
    assert admit(kv, "b", [1, 2, 3, 4, 5, 6, 7]) == 4
    kv.check_invariants()


def test_identical_blocks_computed_twice_stay_private_to_the_late_one():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    prompt = list(range(9))
    admit(kv, "a", prompt)
    admit(kv, "b", prompt)  # admitted before a's blocks were committed: no hit
    before = list(kv.block_table("b"))
    commit(kv, "a", prompt)
    commit(kv, "b", prompt)
    assert kv.block_table("b") == before  # tables never change: b keeps computing into its own blocks
    assert kv.num_cached_blocks == 2 and kv.seqs["b"].nodes == kv.seqs["a"].nodes
    kv.free("b")  # its duplicates go back to the pool; a's cached blocks stay
    assert admit(kv, "c", prompt) == 8 and kv.block_table("c")[:2] == kv.block_table("a")[:2]
    kv.check_invariants()


class KVMachine(RuleBasedStateMachine):
    """Random admit / compute / extend / free / evict sequences, with tokens drawn by hypothesis (so failures
    shrink); the invariants hold and block tables only grow."""

    policy = "lru"

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(num_blocks=24, block_size=4, eviction_policy=self.policy)
        self.tokens: dict[int, list[int]] = {}
        self.salts: dict[int, str | None] = {}
        self.tables: dict[int, list[int]] = {}
        self.next_id = 0

    @rule(
        new=st.lists(st.sampled_from((1, 2, 3)), min_size=1, max_size=30),  # tiny alphabet: many shared prefixes
        shared=st.integers(0, 30),
        salt=st.sampled_from([None, "x"]),
    )
    def admit(self, new: list[int], shared: int, salt: str | None) -> None:
        base = next(iter(self.tokens.values()), [])[:shared]
        toks = base + new
        sid = self.next_id
        self.next_id += 1
        num_cached = admit(self.kv, sid, toks, salt)
        if num_cached is not None:
            assert num_cached % 4 == 0 and num_cached < len(toks)
            nodes = self.kv.seqs[sid].nodes
            assert len(nodes) * 4 == num_cached
            for i, node in enumerate(nodes):  # every hit holds exactly this sequence's tokens
                assert node.token_ids == tuple(toks[i * 4 : (i + 1) * 4])
            self.tokens[sid], self.salts[sid] = toks, salt

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def compute(self, data) -> None:
        """The model computed the sequence so far: its full blocks go into the tree."""
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        commit(self.kv, sid, self.tokens[sid], self.salts[sid])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), new=st.lists(st.sampled_from((1, 2, 3)), min_size=1, max_size=9))
    def extend(self, data, new: list[int]) -> None:
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        toks = self.tokens[sid] + new
        if self.kv.allocate(sid, len(toks)) is not None:
            self.tokens[sid] = toks

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data) -> None:
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.kv.free(sid)
        del self.tokens[sid], self.tables[sid]

    @rule(n=st.integers(1, 10))
    def evict(self, n: int) -> None:
        before = self.kv.num_free_blocks
        self.kv.evict(n)
        assert self.kv.num_free_blocks == before  # eviction moves blocks from cached to free, never from in-use

    @invariant()
    def invariants_hold(self) -> None:
        self.kv.check_invariants()
        for sid, toks in self.tokens.items():
            table = self.kv.block_table(sid)
            assert len(table) >= self.kv.blocks_needed(len(toks))
            assert table[: len(self.tables.get(sid, []))] == self.tables.get(sid, [])  # append-only
            self.tables[sid] = list(table)


class FIFOMachine(KVMachine):
    policy = "fifo"


TestLRUMachine = pytest.mark.slow(KVMachine.TestCase)  # hypothesis runs many steps
TestLRUMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestFIFOMachine = pytest.mark.slow(FIFOMachine.TestCase)  # hypothesis runs many steps
TestFIFOMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


@pytest.mark.parametrize("seed", range(3))
def test_every_cached_block_matches_the_tokens_that_made_it(seed):
    rng = random.Random(seed)
    kv = KVCacheManager(num_blocks=40, block_size=4)
    written: dict[int, tuple[int, ...]] = {}  # block id -> the tokens whose K/V the "model" wrote there
    for sid in range(60):
        toks = [rng.randint(0, 2) for _ in range(rng.randint(2, 24))]
        num_cached = admit(kv, sid, toks)
        if num_cached is None:
            kv.evict(40)
            continue
        table = kv.block_table(sid)
        for i in range(num_cached // 4):  # hits must point at blocks holding exactly these tokens
            assert written[table[i]] == tuple(toks[i * 4 : (i + 1) * 4])
        for i in range(num_cached // 4, len(table)):
            written[table[i]] = tuple(toks[i * 4 : (i + 1) * 4])
        commit(kv, sid, toks)
        if rng.random() < 0.7:
            kv.free(sid)
        kv.check_invariants()
