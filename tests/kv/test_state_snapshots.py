"""The KV manager of a hybrid model (pages + recurrent-state rows, engine/kv/): random admissions, commits,
snapshots, frees, evictions and steps keep every invariant (each slot exactly one of free / running / pending /
snapshot, snapshots owned by nodes in the tree), and a hit always ends on a block whose snapshot was taken in an
earlier step. With host and disk tiers: following the copy instructions, every snapshot in every tier holds the state
at its own block's end, a hit resumes from that state, and replaying the events gives each tier's blocks and which
of them carry snapshots."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kv.block_hashing import BlockHasher
from engine.kv.manager import KVCacheManager
from engine.outputs import TransferKind
from tests.kv.kv_model import BlockContents, EventReplay

BS = 4
PROMPTS = [[1, 2, 3, 4] * k + [9, k] for k in range(1, 6)] + [[5, 6, 7, 8] * 3 + [1, 2]]

ops = st.lists(st.tuples(st.sampled_from(["admit", "snapshot", "free", "evict", "step"]),
                         st.integers(0, len(PROMPTS) - 1), st.integers(1, 5)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_random_operations_keep_the_invariants(script):
    kv = KVCacheManager(24, BS, state_rows=5)
    hasher = BlockHasher(BS, "m")
    live: dict[str, list[int]] = {}
    counter = 0
    for op, which, n in script:
        if op == "step":
            kv.begin_step()
        elif op == "admit":
            prompt = PROMPTS[which]
            hashes = hasher.hashes(prompt, None)
            counter += 1
            seq = f"s{counter}"
            cached = kv.admit(seq, hashes, prompt, len(prompt))
            if cached is not None:
                if cached:  # the hit ends on a usable snapshot: restored into the sequence's slot
                    node = kv.by_hash[hashes[cached // BS - 1]]
                    assert node.snapshot_row >= 0 and node.snapshot_step < kv.states.step
                    assert kv.state_restores[-1].dst == kv.state_row(seq)
                kv.commit(seq, hashes, prompt, len(prompt))
                live[seq] = prompt
        elif op == "snapshot" and live:
            seq = sorted(live)[which % len(live)]
            boundary = min(n, len(live[seq]) // BS) * BS
            kv.take_snapshot(seq, boundary, replaces_reply=n % 2 == 0)
        elif op == "free" and live:
            seq = sorted(live)[which % len(live)]
            kv.free(seq)
            del live[seq]
        elif op == "evict":
            kv.evict(n)
        kv.check_invariants()
        kv.take_state_copies()


class Hybrid:
    """A hybrid KV manager with a host tier, driven as the scheduler and runner drive it (copies applied in the
    runner's order to a model of the contents, events replayed)."""

    def __init__(self, **options) -> None:
        self.kv = KVCacheManager(**{"num_blocks": 8, "block_size": BS, "state_rows": 3, "host_blocks": 8,
                                    "host_states": 2, "record_events": True, **options})
        self.hasher = BlockHasher(BS, "m")
        self.contents, self.replay = BlockContents(), EventReplay(block_size=BS)

    def sync(self, snapshots: dict[int, bytes] | None = None) -> list:
        transfers = self.kv.take_transfers()
        self.contents.apply(transfers)
        restores, copies = self.kv.take_state_copies()
        self.contents.copy_states(restores)
        for copy in copies:
            self.contents.states[copy.dst] = snapshots[copy.dst]
        self.replay.apply(self.kv.take_events())
        return transfers

    def run(self, seq: str, prompt: list[int], snapshot_at: int = 0) -> tuple[int, list]:
        """Admit, compute, commit (snapshotting at ``snapshot_at`` tokens), free, next step; (cached, transfers)."""
        hashes = self.hasher.hashes(prompt, None)
        cached = self.kv.admit(seq, hashes, prompt, len(prompt))
        transfers = self.sync()
        if cached:
            assert self.contents.states[self.kv.state_row(seq)] == hashes[cached // BS - 1]
        self.contents.compute(self.kv, seq, prompt)
        self.kv.commit(seq, hashes, prompt, len(prompt))
        snapshots = {}
        if snapshot_at and self.kv.take_snapshot(seq, snapshot_at):
            snapshots[self.kv.state_snapshots[-1].dst] = hashes[snapshot_at // BS - 1]
        transfers += self.sync(snapshots)
        self.kv.free(seq)
        self.kv.begin_step()
        self.kv.check_invariants()
        self.contents.check(self.kv)
        self.replay.check(self.kv)
        return cached, transfers


def test_an_evicted_block_takes_its_snapshot_to_the_host_and_back():
    h = Hybrid()
    prompt = list(range(1, 15))  # three full blocks and two tokens
    h.run("a", prompt, snapshot_at=12)
    h.kv.evict(8)
    offloads = [t.kind for t in h.sync()]
    assert offloads.count(TransferKind.OFFLOAD) == 3 and offloads.count(TransferKind.OFFLOAD_STATE) == 1
    assert h.replay.snapshots["CPU"] == {h.hasher.hashes(prompt, None)[2]} and not h.kv.by_hash
    cached, transfers = h.run("b", prompt)
    assert cached == 12  # pages and state restored from the host
    assert [t.kind for t in transfers].count(TransferKind.RESTORE_STATE) == 1


def test_a_snapshot_pushed_out_of_the_state_pool_goes_to_the_host_alone_and_comes_back():
    """Its block stays on the device: a later hit copies back only the state."""
    h = Hybrid(num_blocks=24, state_rows=2, host_states=4)
    shared = list(range(1, 9))
    h.run("a", shared + [50, 51, 52, 53, 54], snapshot_at=8)
    h.run("b", [60 + i for i in range(13)], snapshot_at=12)  # takes the last slot: a's snapshot goes to the host
    h.run("c", [70 + i for i in range(13)], snapshot_at=12)
    assert h.kv.by_hash[h.hasher.hashes(shared, None)[1]].snapshot_row < 0  # the block stays, its snapshot left
    cached, transfers = h.run("d", shared + [80, 81, 82])
    assert cached == 8
    assert [t.kind for t in transfers if t.kind is not TransferKind.OFFLOAD_STATE] == [TransferKind.RESTORE_STATE]


tier_ops = st.lists(st.tuples(st.sampled_from(["run", "run", "evict"]), st.integers(0, len(PROMPTS) - 1),
                              st.integers(0, 5)), max_size=40)


@settings(max_examples=150, deadline=None)
@given(tier_ops)
def test_snapshots_travel_through_the_host_and_disk_tiers(script):
    """Sessions (each snapshotting at a random boundary) and evictions over a small device pool with host and disk
    tiers: every hit resumes from the state at its end, wherever it was kept (checked in `Hybrid.run`)."""
    h = Hybrid(num_blocks=12, state_rows=3, host_blocks=4, disk_blocks=10, host_states=1, disk_states=3)
    for i, (op, which, n) in enumerate(script):
        if op == "run":
            prompt = PROMPTS[which]
            h.run(f"s{i}", prompt, snapshot_at=min(n, len(prompt) // BS) * BS)
        else:
            h.kv.evict(n)
            h.sync()
            h.kv.check_invariants()
            h.contents.check(h.kv)
            h.replay.check(h.kv)


def test_a_new_snapshot_does_not_evict_a_branch_point():
    """Two sequences branched at a's snapshot: a third, unrelated one's snapshot finds no slot rather than evicting
    the state both resume from (while branches hold at most half the pool); plain LRU evicts it."""
    shared = list(range(1, 9))
    for weigh, kept in ((True, True), (False, False)):
        h = Hybrid(num_blocks=24, state_rows=2, weigh_snapshots=weigh)
        h.run("a", shared + [50, 51, 52, 53, 54], snapshot_at=8)
        assert h.run("b", shared + [60, 61, 62, 63, 64])[0] == 8  # now a branch point
        h.run("c", [70 + i for i in range(13)], snapshot_at=12)
        assert (h.kv.by_hash[h.hasher.hashes(shared, None)[1]].snapshot_row >= 0) is kept
