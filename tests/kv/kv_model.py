"""Test doubles that follow the KV manager's outputs the way the runner and a router do: `BlockContents` applies
the copy instructions to a model of the device blocks, host blocks and disk files; `EventReplay` rebuilds each
tier's block set from the events. Both let a test check the manager against what it told the outside world."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.kv.manager import KVCacheManager
from engine.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from engine.outputs import KVTransfer, StateCopy, TransferKind


@dataclass
class BlockContents:
    """What each device block, host block and disk file holds (the tokens whose K/V the "model" wrote there); for a
    hybrid model also what each device state row, host state row and disk snapshot holds (the hash of the block
    at whose end the state is); for a sliding-window model what each device window page holds (the tokens up to
    the end of its block) and each host row and disk file's window (its pages' contents)."""

    device: dict[int, tuple[int, ...]] = field(default_factory=dict)
    host: dict[int, tuple[int, ...]] = field(default_factory=dict)
    disk: dict[bytes, tuple[int, ...]] = field(default_factory=dict)
    states: dict[int, bytes] = field(default_factory=dict)
    host_states: dict[int, bytes] = field(default_factory=dict)
    disk_states: dict[bytes, bytes] = field(default_factory=dict)
    window: dict[int, tuple[int, ...]] = field(default_factory=dict)

    def apply(self, transfers: list[KVTransfer]) -> None:
        for t in transfers:
            if t.kind is TransferKind.OFFLOAD:
                self.host[t.host_block] = self.device[t.block_id]
            elif t.kind is TransferKind.RESTORE:
                self.device[t.block_id] = self.host[t.host_block]
            elif t.kind is TransferKind.OFFLOAD_STATE:
                self.host_states[t.host_state_row] = (tuple(self.window[p] for p in t.window_pages) if t.window_pages
                                                      else self.states[t.state_row])
            elif t.kind is TransferKind.RESTORE_STATE:
                self._restore_state(t, self.host_states[t.host_state_row])
            elif t.kind is TransferKind.DISK_WRITE:
                self.disk[t.block_hash] = self.host[t.host_block]
                self.disk_states.pop(t.block_hash, None)
                if t.host_state_row >= 0:
                    self.disk_states[t.block_hash] = self.host_states[t.host_state_row]
            elif t.kind is TransferKind.DISK_READ:
                if t.block_id >= 0:
                    self.device[t.block_id] = self.disk[t.block_hash]
                if t.state_row >= 0 or t.window_pages:
                    self._restore_state(t, self.disk_states[t.block_hash])
            elif t.kind is TransferKind.DISK_DELETE:
                del self.disk[t.block_hash]
                self.disk_states.pop(t.block_hash, None)
            else:
                self.disk.clear()
                self.disk_states.clear()

    def _restore_state(self, t: KVTransfer, held) -> None:
        if t.window_pages:
            assert len(held) == len(t.window_pages), "a window is restored into another number of pages"
            self.window.update(zip(t.window_pages, held))
        else:
            self.states[t.state_row] = held

    def copy_states(self, copies: list[StateCopy]) -> None:
        for copy in copies:
            self.states[copy.dst] = self.states[copy.src]

    def compute(self, kv: KVCacheManager, seq_id, token_ids: list[int]) -> None:
        """The model wrote the sequence's K/V into its blocks (all of them, as a forward over the sequence would)."""
        bs = kv.block_size
        for i, block_id in enumerate(kv.block_table(seq_id)):
            if i * bs < len(token_ids):
                self.device[block_id] = tuple(token_ids[i * bs : (i + 1) * bs])

    def check(self, kv: KVCacheManager) -> None:
        """Every cached block, in every tier, holds exactly the tokens it is indexed under."""
        for node in kv.by_hash.values():
            assert self.device.get(node.block_id) == node.token_ids, f"device block {node.block_id} holds other K/V"
        if kv.tiers.host is not None:
            for block in kv.tiers.host.blocks.values():
                assert self.host.get(block.index) == block.token_ids, f"host block {block.index} holds other K/V"
        if kv.tiers.disk is not None:
            for block_hash, block in kv.tiers.disk.blocks.items():
                assert self.disk.get(block_hash) == block.token_ids, "a disk file holds other K/V"
        if kv.window is not None:
            self._check_windows(kv)
        if kv.states is None:
            return
        for node in kv.by_hash.values():
            if node.snapshot_row >= 0:
                assert self.states.get(node.snapshot_row) == node.block_hash, "a snapshot holds another state"
        for tier, held in ((kv.tiers.host, lambda h, b: self.host_states.get(b.state_row)),
                           (kv.tiers.disk, lambda h, b: self.disk_states.get(h))):
            for block_hash, block in (tier.blocks.items() if tier is not None else ()):
                if block.state_row >= 0:
                    assert held(block_hash, block) == block_hash, f"a {tier.medium} snapshot holds another state"


    def _check_windows(self, kv: KVCacheManager) -> None:
        """Every tier's window is the window of its block: pages of consecutive blocks, the last one ending with the
        block's tokens, as many as a resume there reads."""
        for tier, held in ((kv.tiers.host, lambda h, b: self.host_states.get(b.state_row)),
                           (kv.tiers.disk, lambda h, b: self.disk_states.get(h))):
            for block_hash, block in (tier.blocks.items() if tier is not None else ()):
                if block.state_row < 0:
                    continue
                pages = held(block_hash, block)
                end = len(pages[-1])
                assert pages[-1][-kv.block_size:] == block.token_ids, f"a {tier.medium} window ends elsewhere"
                assert len(pages) == end // kv.block_size - kv.window.first_block(end), f"a {tier.medium} window's size"
                assert all(a == b[: len(a)] and len(b) == len(a) + kv.block_size for a, b in zip(pages, pages[1:]))


@dataclass
class EventReplay:
    """Each tier's block set, as a router learns it from the event stream; for a hybrid model also which of those
    blocks carry a snapshot (a repeated `BlockStored` of a held block updates only that)."""

    block_size: int = 4
    tiers: dict[str, set[bytes]] = field(default_factory=dict)
    snapshots: dict[str, set[bytes]] = field(default_factory=dict)

    def apply(self, events: list[KVEvent]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                held = self.tiers.setdefault(event.medium, set())
                if event.snapshot_hashes is None:
                    assert not held & set(event.block_hashes), "a block was stored twice in one tier"
                else:
                    assert set(event.snapshot_hashes) <= set(event.block_hashes)
                    flagged = self.snapshots.setdefault(event.medium, set())
                    flagged.difference_update(event.block_hashes)
                    flagged.update(event.snapshot_hashes)
                held.update(event.block_hashes)
                assert len(event.token_ids) == len(event.block_hashes) * self.block_size
            elif isinstance(event, BlockRemoved):
                held = self.tiers.setdefault(event.medium, set())
                assert set(event.block_hashes) <= held, "a block was removed that was never stored"
                held.difference_update(event.block_hashes)
                self.snapshots.setdefault(event.medium, set()).difference_update(event.block_hashes)
            else:
                assert isinstance(event, AllBlocksCleared)
                self.tiers.clear()
                self.snapshots.clear()

    def check(self, kv: KVCacheManager) -> None:
        assert self.tiers.get("GPU", set()) == set(kv.by_hash)
        for tier in kv.tiers.tiers():
            assert self.tiers.get(tier.medium, set()) == set(tier.blocks), tier.medium
        if kv.states is not None or kv.window is not None:
            assert self.snapshots.get("GPU", set()) == {h for h, n in kv.by_hash.items()
                                                        if n.snapshot_row >= 0 or n.window_pages is not None}
            for tier in kv.tiers.tiers():
                assert self.snapshots.get(tier.medium, set()) == set(tier.states), f"{tier.medium} snapshots"
