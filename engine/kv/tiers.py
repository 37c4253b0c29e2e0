"""The index of a KV tier below the device pool (host memory, disk): which blocks it holds, keyed by the same block
hashes as the prefix tree, with its own LRU order.

Bookkeeping only (no tensors, no files): the KV manager decides what moves where and emits copy instructions; the
model runner's `engine.worker.kv_offload` moves the bytes. Each block of a tier has an index in it (its row of the host
pool's tensors; the disk tier uses indexes only to count its capacity). Tiers are inclusive: a block restored to the device keeps its
lower-tier copy, so evicting it again costs no copy.

A hybrid model's snapshot (the recurrent state at a block's end, `engine.kv.state_pool`) travels with its block, under
the same hash: a tier keeps a few *state rows* (a snapshot weighs as much as thousands of tokens' K/V), each owned
by one of its blocks, least recently used first. The host pool drops a snapshot alone when it needs the row; the
disk tier drops the block with it (its file holds both).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

from engine.kv.block_hashing import BlockHash
from engine.kv.events import MEDIUM_DISK, MEDIUM_HOST, EventRecorder
from engine.outputs import KVTransfer, TransferKind


@dataclass(slots=True)
class TierBlock:
    index: int  # its row in the tier (the host pool's tensors)
    token_ids: tuple[int, ...]
    parent_hash: BlockHash | None  # the previous block of its chain (for the KV events and the disk files)
    state_row: int = -1  # hybrid models: the state row holding the snapshot at this block's end (-1: none)


# A block found at start-up (the disk tier after a restart): hash, tokens, parent, and whether it has a snapshot
FoundBlock = tuple[BlockHash, tuple[int, ...], "BlockHash | None", bool]


class TierIndex:
    def __init__(self, medium: str, capacity: int, state_capacity: int = 0) -> None:
        self.medium = medium  # its name in the KV events ("CPU", "DISK")
        self.capacity = capacity
        self.state_capacity = state_capacity
        self.blocks: OrderedDict[BlockHash, TierBlock] = OrderedDict()  # least recently used first
        self.states: OrderedDict[BlockHash, None] = OrderedDict()  # the blocks holding a snapshot, LRU first
        self._free = list(range(capacity - 1, -1, -1))  # pop() hands out low indexes first
        self._free_state_rows = list(range(state_capacity - 1, -1, -1))

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self.blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def get(self, block_hash: BlockHash) -> TierBlock | None:
        return self.blocks.get(block_hash)

    def touch(self, block_hash: BlockHash) -> None:
        self.blocks.move_to_end(block_hash)
        if block_hash in self.states:
            self.states.move_to_end(block_hash)

    def add(self, block_hash: BlockHash, token_ids: tuple[int, ...], parent_hash: BlockHash | None,
            keep: Collection[BlockHash] = ()) -> tuple[TierBlock | None, list[tuple[BlockHash, TierBlock]]]:
        """Take an index for a new block, dropping least recently used blocks (never those in ``keep``: an admission
        is about to read them) when the tier is full. Returns the new block (None: no room) and the dropped ones."""
        assert block_hash not in self.blocks
        dropped: list[tuple[BlockHash, TierBlock]] = []
        if not self._free:
            victim = next((h for h in self.blocks if h not in keep), None)
            if victim is None:
                return None, dropped
            dropped.append((victim, self.remove(victim)))
        block = TierBlock(self._free.pop(), token_ids, parent_hash)
        self.blocks[block_hash] = block
        return block, dropped

    def remove(self, block_hash: BlockHash) -> TierBlock:
        if block_hash in self.states:
            self.remove_state(block_hash)
        block = self.blocks.pop(block_hash)
        self._free.append(block.index)
        return block

    def has_state(self, block_hash: BlockHash) -> bool:
        return block_hash in self.states

    def add_state(self, block_hash: BlockHash, keep: Collection[BlockHash] = ()) -> tuple[int | None, BlockHash | None]:
        """A state row for the snapshot at the end of a block this tier holds, dropping the least recently used
        snapshot (never one in ``keep``) when every row is taken. Returns (the row or None: no room, the block whose
        snapshot was dropped or None)."""
        block = self.blocks[block_hash]
        assert block.state_row < 0
        victim = None
        if not self._free_state_rows:
            victim = next((h for h in self.states if h not in keep), None)
            if victim is None:
                return None, None
            self.remove_state(victim)
        block.state_row = self._free_state_rows.pop()
        self.states[block_hash] = None
        return block.state_row, victim

    def remove_state(self, block_hash: BlockHash) -> None:
        block = self.blocks[block_hash]
        del self.states[block_hash]
        self._free_state_rows.append(block.state_row)
        block.state_row = -1

    def load(self, blocks: Iterable[FoundBlock]) -> tuple[list[BlockHash], list[BlockHash]]:
        """Index blocks found at startup (the disk tier after a restart), given oldest first: the newest that fit
        are taken (in LRU order), the rest are left over (a restart with a smaller tier); their snapshots too, as
        far as state rows go. Returns (taken, left)."""
        blocks = list(blocks)
        left = [b[0] for b in blocks[: max(0, len(blocks) - len(self._free))]]
        taken = []
        for block_hash, token_ids, parent_hash, has_state in blocks[len(left):]:
            if block_hash in self.blocks:
                continue
            self.blocks[block_hash] = TierBlock(self._free.pop(), token_ids, parent_hash)
            if has_state and self._free_state_rows:
                self.add_state(block_hash)
            taken.append(block_hash)
        return taken, left

    def clear(self) -> list[BlockHash]:
        hashes = list(self.blocks)
        self.blocks.clear()
        self.states.clear()
        self._free = list(range(self.capacity - 1, -1, -1))
        self._free_state_rows = list(range(self.state_capacity - 1, -1, -1))
        return hashes

    def check_invariants(self) -> None:
        used = [b.index for b in self.blocks.values()]
        assert len(set(used)) == len(used), f"{self.medium}: an index holds two blocks"
        assert all(0 <= i < self.capacity for i in used)
        assert not set(used) & set(self._free), f"{self.medium}: an index is both free and used"
        assert len(used) + len(self._free) == self.capacity, f"{self.medium}: an index is lost"
        rows = [b.state_row for b in self.blocks.values() if b.state_row >= 0]
        assert sorted(rows) == sorted(self.blocks[h].state_row for h in self.states), f"{self.medium}: state rows"
        assert len(set(rows)) == len(rows) and not set(rows) & set(self._free_state_rows)
        assert len(rows) + len(self._free_state_rows) == self.state_capacity, f"{self.medium}: a state row is lost"


class LowerTiers:
    """The host pool and the disk tier under the device pool: where an evicted device block goes (host, written
    through to disk), and where a device miss looks next. Records the copies as `KVTransfer`s, in order, and the
    tiers' changes as KV events."""

    def __init__(self, host_blocks: int, disk_blocks: int, events: EventRecorder, host_states: int = 0,
                 disk_states: int = 0) -> None:
        if disk_blocks and not host_blocks:
            raise ValueError("the disk tier is written through the host pool: give the host pool blocks too")
        self.host = TierIndex(MEDIUM_HOST, host_blocks, host_states) if host_blocks else None
        self.disk = TierIndex(MEDIUM_DISK, disk_blocks, disk_states) if disk_blocks else None
        # Reads and checks a disk block before admission counts on it (the runner's `KVOffload.read_disk_block`).
        self.disk_reader: Callable[[BlockHash], bool] | None = None
        self.events = events
        self.transfers: list[KVTransfer] = []
        self.host_drops = 0  # blocks the full host pool gave up (least recently used first)
        self.disk_drops = 0  # ... and the full disk tier

    @property
    def enabled(self) -> bool:
        return self.host is not None

    def tiers(self) -> list[TierIndex]:
        return [t for t in (self.host, self.disk) if t is not None]

    def find(self, block_hash: BlockHash) -> tuple[TierIndex, TierBlock] | None:
        """The fastest tier holding the block."""
        for tier in self.tiers():
            block = tier.get(block_hash)
            if block is not None:
                return tier, block
        return None

    def find_state(self, block_hash: BlockHash) -> TierIndex | None:
        """The fastest tier holding the snapshot at the end of the block."""
        return next((tier for tier in self.tiers() if tier.has_state(block_hash)), None)

    def offload(self, block_hash: BlockHash, block_id: int, token_ids: tuple[int, ...], parent: BlockHash | None,
                keep: Collection[BlockHash] = (), state_row: int = -1) -> None:
        """Keep the contents of device block ``block_id`` in the host pool and, written through, on disk (before
        the block is reused, or before a shutdown); with the snapshot in device state row ``state_row`` (>= 0)."""
        host, disk = self.host, self.disk
        if host is None:
            return
        held = host.get(block_hash)
        if held is not None:
            host.touch(block_hash)  # already there (it was restored from the host): no copy
        else:
            held = self._add(host, block_hash, token_ids, parent, keep)
            if held is None:
                return
            self.transfers.append(KVTransfer(TransferKind.OFFLOAD, block_id=block_id, host_block=held.index))
        if state_row >= 0 and held.state_row < 0 and self._add_state(host, block_hash, keep):
            self.transfers.append(KVTransfer(TransferKind.OFFLOAD_STATE, state_row=state_row,
                                             host_state_row=held.state_row))
        if disk is None:
            return
        on_disk, write = disk.get(block_hash), False
        if on_disk is None:
            on_disk = self._add(disk, block_hash, token_ids, parent, keep)
            write = on_disk is not None
        if on_disk is not None and held.state_row >= 0 and on_disk.state_row < 0:
            write |= self._add_state(disk, block_hash, keep)
        if write and block_hash in disk:  # (re)written with the snapshot the host holds, if the disk keeps it
            self.transfers.append(KVTransfer(TransferKind.DISK_WRITE, host_block=held.index, block_hash=block_hash,
                                             parent_hash=parent, token_ids=token_ids,
                                             host_state_row=held.state_row if disk.has_state(block_hash) else -1))

    def _add_state(self, tier: TierIndex, block_hash: BlockHash, keep: Collection[BlockHash]) -> bool:
        """Give the tier's block its snapshot, making room as the tier does (module docstring)."""
        row, victim = tier.add_state(block_hash, keep)
        if victim is not None:
            if tier is self.disk:  # its file holds the snapshot: the block goes with it
                self._drop(tier, victim)
            else:
                dropped = tier.blocks[victim]
                self.events.stored(victim, dropped.parent_hash, dropped.token_ids, tier.medium, snapshot=False)
        if row is None:
            return False
        block = tier.blocks[block_hash]
        self.events.stored(block_hash, block.parent_hash, block.token_ids, tier.medium, snapshot=True)
        return True

    def _drop(self, tier: TierIndex, block_hash: BlockHash) -> None:
        tier.remove(block_hash)
        self.events.removed(block_hash, tier.medium)
        if tier is self.disk:
            self.transfers.append(KVTransfer(TransferKind.DISK_DELETE, block_hash=block_hash))

    def _add(self, tier: TierIndex, block_hash: BlockHash, token_ids: tuple[int, ...], parent: BlockHash | None,
             keep: Collection[BlockHash]) -> TierBlock | None:
        block, dropped = tier.add(block_hash, token_ids, parent, keep)
        if tier is self.disk:
            self.disk_drops += len(dropped)
        else:
            self.host_drops += len(dropped)
        for dropped_hash, _ in dropped:  # (a dropped block's snapshot goes with it)
            self.events.removed(dropped_hash, tier.medium)
            if tier is self.disk:
                self.transfers.append(KVTransfer(TransferKind.DISK_DELETE, block_hash=dropped_hash))
        if block is not None:
            self.events.stored(block_hash, parent, token_ids, tier.medium)
        return block

    def usable(self, tier: TierIndex, block_hash: BlockHash) -> bool:
        """Whether an admission can restore this block; a disk block whose file cannot be read or fails its
        checksum is dropped instead (a miss: the block is recomputed), its file deleted."""
        if tier is not self.disk or self.disk_reader is None or self.disk_reader(block_hash):
            return True
        self._drop(self.disk, block_hash)
        return False

    def restore(self, tier: TierIndex, block_hash: BlockHash, block_id: int, state_row: int = -1) -> None:
        """Copy a lower-tier block into device block ``block_id`` (-1: not its pages) and its snapshot into device
        state row ``state_row`` (-1: not its snapshot), before the step's forward reads them."""
        tier.touch(block_hash)
        if tier is self.disk:
            self.transfers.append(KVTransfer(TransferKind.DISK_READ, block_id=block_id, block_hash=block_hash,
                                             state_row=state_row))
            return
        block = tier.blocks[block_hash]
        if block_id >= 0:
            self.transfers.append(KVTransfer(TransferKind.RESTORE, block_id=block_id, host_block=block.index))
        if state_row >= 0:
            self.transfers.append(KVTransfer(TransferKind.RESTORE_STATE, state_row=state_row,
                                             host_state_row=block.state_row))

    def load_disk(self, blocks: Iterable[FoundBlock]) -> int:
        """Index the block files a previous run left (oldest first); the oldest beyond the tier's size are deleted
        (a restart with a smaller tier keeps to it). Returns how many were taken."""
        if self.disk is None:
            return 0
        taken, left = self.disk.load(blocks)
        for block_hash in taken:
            block = self.disk.blocks[block_hash]
            self.events.stored(block_hash, block.parent_hash, block.token_ids, MEDIUM_DISK,
                               snapshot=block.state_row >= 0)
        self.transfers += [KVTransfer(TransferKind.DISK_DELETE, block_hash=h) for h in left]
        return len(taken)

    def clear(self) -> None:
        for tier in self.tiers():
            for block_hash in tier.clear():
                self.events.removed(block_hash, tier.medium)
        if self.disk is not None:
            self.transfers.append(KVTransfer(TransferKind.DISK_CLEAR))

    def take_transfers(self) -> list[KVTransfer]:
        transfers, self.transfers = self.transfers, []
        return transfers
