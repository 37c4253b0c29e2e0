"""The KV manager of a hybrid model (pages + recurrent-state slots, engine/kv/): random admissions, commits,
snapshots, frees, evictions and steps keep every invariant (each slot exactly one of free / running / pending /
snapshot, snapshots owned by nodes in the tree), and a hit always ends on a block whose snapshot was taken in an
earlier step."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.block_hashing import BlockHasher
from engine.kv_cache import KVCacheManager

BS = 4
PROMPTS = [[1, 2, 3, 4] * k + [9, k] for k in range(1, 6)] + [[5, 6, 7, 8] * 3 + [1, 2]]

ops = st.lists(st.tuples(st.sampled_from(["admit", "snapshot", "free", "evict", "step"]),
                         st.integers(0, len(PROMPTS) - 1), st.integers(1, 5)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_random_operations_keep_the_invariants(script):
    kv = KVCacheManager(24, BS, state_slots=5)
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
                    assert node.snapshot_slot >= 0 and node.snapshot_step < kv.states.step
                    assert kv.state_restores[-1].dst == kv.state_slot(seq)
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
