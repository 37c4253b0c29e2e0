"""The index of a KV tier below the device pool (host memory, disk): which blocks it holds, keyed by the same block
hashes as the prefix tree, with its own LRU order.

Bookkeeping only (no tensors, no files): the KV manager decides what moves where and emits copy instructions; the
model runner's `engine.kv_offload` moves the bytes. Each block of a tier has an index in it (its row of the host
pool's tensors; the disk tier uses indexes only to count its capacity). Tiers are inclusive: a block restored to the device keeps its
lower-tier copy, so evicting it again costs no copy.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

from engine.block_hashing import BlockHash
from engine.kv_events import MEDIUM_DISK, MEDIUM_HOST, EventRecorder
from engine.outputs import KVTransfer, TransferKind


@dataclass(slots=True)
class TierBlock:
    index: int  # its row in the tier (the host pool's tensors)
    token_ids: tuple[int, ...]
    parent_hash: BlockHash | None  # the previous block of its chain (for the KV events and the disk files)


class TierIndex:
    def __init__(self, medium: str, capacity: int) -> None:
        self.medium = medium  # its name in the KV events ("CPU", "DISK")
        self.capacity = capacity
        self.blocks: OrderedDict[BlockHash, TierBlock] = OrderedDict()  # least recently used first
        self._free = list(range(capacity - 1, -1, -1))  # pop() hands out low indexes first

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self.blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def get(self, block_hash: BlockHash) -> TierBlock | None:
        return self.blocks.get(block_hash)

    def touch(self, block_hash: BlockHash) -> None:
        self.blocks.move_to_end(block_hash)

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
        block = self.blocks.pop(block_hash)
        self._free.append(block.index)
        return block

    def load(self, blocks: Iterable[tuple[BlockHash, tuple[int, ...], BlockHash | None]]
             ) -> tuple[list[BlockHash], list[BlockHash]]:
        """Index blocks found at startup (the disk tier after a restart), given oldest first: the newest that fit
        are taken (in LRU order), the rest are left over (a restart with a smaller tier). Returns (taken, left)."""
        blocks = list(blocks)
        left = [b[0] for b in blocks[: max(0, len(blocks) - len(self._free))]]
        taken = []
        for block_hash, token_ids, parent_hash in blocks[len(left):]:
            if block_hash in self.blocks:
                continue
            self.blocks[block_hash] = TierBlock(self._free.pop(), token_ids, parent_hash)
            taken.append(block_hash)
        return taken, left

    def clear(self) -> list[BlockHash]:
        hashes = list(self.blocks)
        self.blocks.clear()
        self._free = list(range(self.capacity - 1, -1, -1))
        return hashes

    def check_invariants(self) -> None:
        used = [b.index for b in self.blocks.values()]
        assert len(set(used)) == len(used), f"{self.medium}: an index holds two blocks"
        assert all(0 <= i < self.capacity for i in used)
        assert not set(used) & set(self._free), f"{self.medium}: an index is both free and used"
        assert len(used) + len(self._free) == self.capacity, f"{self.medium}: an index is lost"


class LowerTiers:
    """The host pool and the disk tier under the device pool: where an evicted device block goes (host, written
    through to disk), and where a device miss looks next. Records the copies as `KVTransfer`s, in order, and the
    tiers' changes as KV events."""

    def __init__(self, host_blocks: int, disk_blocks: int, events: EventRecorder) -> None:
        if disk_blocks and not host_blocks:
            raise ValueError("the disk tier is written through the host pool: give the host pool blocks too")
        self.host = TierIndex(MEDIUM_HOST, host_blocks) if host_blocks else None
        self.disk = TierIndex(MEDIUM_DISK, disk_blocks) if disk_blocks else None
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

    def offload(self, block_hash: BlockHash, block_id: int, token_ids: tuple[int, ...], parent: BlockHash | None,
                keep: Collection[BlockHash] = ()) -> None:
        """Keep the contents of device block ``block_id`` in the host pool and, written through, on disk (before
        the block is reused, or before a shutdown)."""
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
        if disk is not None and block_hash not in disk and self._add(disk, block_hash, token_ids, parent, keep):
            self.transfers.append(KVTransfer(TransferKind.DISK_WRITE, host_block=held.index, block_hash=block_hash,
                                             parent_hash=parent, token_ids=token_ids))

    def _add(self, tier: TierIndex, block_hash: BlockHash, token_ids: tuple[int, ...], parent: BlockHash | None,
             keep: Collection[BlockHash]) -> TierBlock | None:
        block, dropped = tier.add(block_hash, token_ids, parent, keep)
        if tier is self.disk:
            self.disk_drops += len(dropped)
        else:
            self.host_drops += len(dropped)
        for dropped_hash, _ in dropped:
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
        self.disk.remove(block_hash)
        self.events.removed(block_hash, MEDIUM_DISK)
        self.transfers.append(KVTransfer(TransferKind.DISK_DELETE, block_hash=block_hash))
        return False

    def restore(self, tier: TierIndex, block_hash: BlockHash, block_id: int) -> None:
        """Copy a lower-tier block into device block ``block_id`` (before the step's forward reads it)."""
        tier.touch(block_hash)
        if tier is self.host:
            host_block = tier.blocks[block_hash].index
            self.transfers.append(KVTransfer(TransferKind.RESTORE, block_id=block_id, host_block=host_block))
        else:
            self.transfers.append(KVTransfer(TransferKind.DISK_READ, block_id=block_id, block_hash=block_hash))

    def load_disk(self, blocks: Iterable[tuple[BlockHash, tuple[int, ...], BlockHash | None]]) -> int:
        """Index the block files a previous run left (oldest first); the oldest beyond the tier's size are deleted
        (a restart with a smaller tier keeps to it). Returns how many were taken."""
        if self.disk is None:
            return 0
        taken, left = self.disk.load(blocks)
        for block_hash in taken:
            block = self.disk.blocks[block_hash]
            self.events.stored(block_hash, block.parent_hash, block.token_ids, MEDIUM_DISK)
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
