"""The KV manager's invariants, checkable at any point (the property tests check them after every operation):
every block of the pool is exactly one of free / cached in the tree / private to a live sequence; reference counts
equal the live holders; held nodes form tree paths; parent links match hashes; the retention count is right and
within its cap; every lower tier's slots are consistent; a sliding-window model's window pages are held by exactly
what counts them (`engine.kv.window_cache.check_window_invariants`), and its tiers keep no block without a retained
window at or below it."""
from __future__ import annotations

from typing import TYPE_CHECKING

from engine.kv.window_cache import check_window_invariants

if TYPE_CHECKING:
    from engine.kv.manager import KVCacheManager


def check_invariants(kv: KVCacheManager, num_unreferenced: int) -> None:
    """Assert them all (``num_unreferenced``: the manager's count of tree nodes nobody holds). O(blocks); for tests
    and debugging."""
    free = set(kv.free_block_ids)
    assert len(free) == len(kv.free_block_ids), "a block is in the free list twice"
    holders: dict[int, int] = {}
    private: set[int] = set()
    for seq in kv.seqs.values():
        assert len(seq.nodes) <= len(seq.block_ids)
        for i, node in enumerate(seq.nodes):
            assert kv.by_hash.get(node.block_hash) is node, "a sequence holds a node that left the tree"
            assert node.parent is (seq.nodes[i - 1] if i else None), "the held nodes are not a path in the tree"
            holders[id(node)] = holders.get(id(node), 0) + 1
        for block_id in seq.private_block_ids():
            assert block_id not in private, f"private block {block_id} is held twice"
            private.add(block_id)
    tree_blocks = set()
    unreferenced = retained = 0
    by_tenant: dict[str, int] = {}
    for block_hash, node in kv.by_hash.items():
        assert node.block_hash == block_hash and node.in_tree
        siblings = node.parent.children if node.parent else kv.roots
        assert siblings.get(block_hash) is node, "parent link does not match the tree"
        if node.parent is not None:
            assert kv.by_hash.get(node.parent.block_hash) is node.parent
        assert node.ref_count == holders.get(id(node), 0), f"block {node.block_id}: ref_count != live holders"
        assert node.block_id not in tree_blocks
        tree_blocks.add(node.block_id)
        unreferenced += node.ref_count == 0
        retained += node.retained
        if node.retained_by is not None:
            assert node.retained, "a tenant counts a block that is not retained"
            by_tenant[node.retained_by] = by_tenant.get(node.retained_by, 0) + 1
        if node.ref_count:
            assert node.parent is None or node.parent.ref_count > 0, "a held block's parent is unreferenced"
    assert unreferenced == num_unreferenced
    assert retained == kv.queue.num_retained <= kv.queue.max_retained, "retention count is off"
    assert by_tenant == kv.queue.retained_by_tenant, "a tenant's retention count is off"
    assert max(by_tenant.values(), default=0) <= kv.queue.max_retained_per_tenant
    assert not (free & tree_blocks) and not (free & private) and not (tree_blocks & private)
    assert len(free) + len(tree_blocks) + len(private) == kv.num_blocks, "a block is lost"
    for tier in kv.tiers.tiers():
        tier.check_invariants()
        if kv.tiers.windows:
            tier.check_windows()
    if kv.states is not None:
        kv.states.check_invariants([seq.state_row for seq in kv.seqs.values()],
                                   [slot for seq in kv.seqs.values() for _, slot in seq.pending_snapshots])
    if kv.window is not None:
        check_window_invariants(kv.window, list(kv.seqs.values()), kv.block_size)
