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

A sliding-window model's retained window (an anchor's pages, `engine.kv.window_pool`) travels the same way: its tier
rows are *window rows*, each the window layers' K/V of the ``pages_per_window`` blocks a resume at its block's end
reads, owned by that block. Without a window at or below it a block of such a model is no use (a hit resumes only
where a window is), so a tier keeps none (``windows``): a block enters a tier only with a window or as the parent of
a block the tier holds, and a block left with neither (its window row taken, its last child dropped) is dropped,
and so on up its chain. Every block of such a tier owns a window row or has a child there (`check_invariants`).
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
    state_row: int = -1  # the row holding the snapshot (hybrid) or the window (sliding window) at its end (-1: none)


# A block found at start-up (the disk tier after a restart): hash, tokens, parent, and whether it has a snapshot
FoundBlock = tuple[BlockHash, tuple[int, ...], "BlockHash | None", bool]


class TierIndex:
    def __init__(self, medium: str, capacity: int, state_capacity: int = 0) -> None:
        self.medium = medium  # its name in the KV events ("CPU", "DISK")
        self.capacity = capacity
        self.state_capacity = state_capacity
        self.blocks: OrderedDict[BlockHash, TierBlock] = OrderedDict()  # least recently used first
        self.states: OrderedDict[BlockHash, None] = OrderedDict()  # the blocks holding a snapshot, LRU first
        self.children: dict[BlockHash, int] = {}  # blocks of this tier whose parent is the key
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
        block = self._insert(block_hash, token_ids, parent_hash)
        return block, dropped

    def _insert(self, block_hash: BlockHash, token_ids: tuple[int, ...], parent_hash: BlockHash | None) -> TierBlock:
        block = self.blocks[block_hash] = TierBlock(self._free.pop(), token_ids, parent_hash)
        if parent_hash is not None:
            self.children[parent_hash] = self.children.get(parent_hash, 0) + 1
        return block

    def remove(self, block_hash: BlockHash) -> TierBlock:
        if block_hash in self.states:
            self.remove_state(block_hash)
        block = self.blocks.pop(block_hash)
        self._free.append(block.index)
        parent = block.parent_hash
        if parent is not None:
            left = self.children[parent] - 1
            if left:
                self.children[parent] = left
            else:
                del self.children[parent]
        return block

    def has_children(self, block_hash: BlockHash) -> bool:
        return block_hash in self.children

    def has_state(self, block_hash: BlockHash) -> bool:
        return block_hash in self.states

    def add_state(self, block_hash: BlockHash, keep: Collection[BlockHash] = (),
                  dominated: bool = False) -> tuple[int | None, BlockHash | None]:
        """A state row for the snapshot at the end of a block this tier holds, dropping the least recently used
        snapshot (never one in ``keep``) when every row is taken; ``dominated``: the new one is the next to go.
        Returns (the row or None: no room, the block whose snapshot was dropped or None)."""
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
        if dominated:
            self.states.move_to_end(block_hash, last=False)
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
            self._insert(block_hash, token_ids, parent_hash)
            if has_state and self._free_state_rows:
                self.add_state(block_hash)
            taken.append(block_hash)
        return taken, left

    def clear(self) -> list[BlockHash]:
        hashes = list(self.blocks)
        self.blocks.clear()
        self.states.clear()
        self.children.clear()
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
        children: dict[BlockHash, int] = {}
        for block in self.blocks.values():
            if block.parent_hash is not None:
                children[block.parent_hash] = children.get(block.parent_hash, 0) + 1
        assert children == self.children, f"{self.medium}: a block's count of children is off"

    def check_windows(self) -> None:
        """A sliding-window model's tier: every block owns a window row or has a child here (else no hit uses it)."""
        for block_hash, block in self.blocks.items():
            assert block.state_row >= 0 or block_hash in self.children, \
                f"{self.medium}: a block with no window at or below it"


class LowerTiers:
    """The host pool and the disk tier under the device pool: where an evicted device block goes (host, written
    through to disk), and where a device miss looks next. Records the copies as `KVTransfer`s, in order, and the
    tiers' changes as KV events. ``windows``: a sliding-window model's tiers, whose rows are retained windows and
    which keep no block without a window at or below it (module docstring)."""

    def __init__(self, host_blocks: int, disk_blocks: int, events: EventRecorder, host_states: int = 0,
                 disk_states: int = 0, windows: bool = False) -> None:
        if disk_blocks and not host_blocks:
            raise ValueError("the disk tier is written through the host pool: give the host pool blocks too")
        self.host = TierIndex(MEDIUM_HOST, host_blocks, host_states) if host_blocks else None
        self.disk = TierIndex(MEDIUM_DISK, disk_blocks, disk_states) if disk_blocks else None
        self.windows = windows
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
        """The fastest tier holding the snapshot (or retained window) at the end of the block."""
        return next((tier for tier in self.tiers() if tier.has_state(block_hash)), None)

    def offload(self, block_hash: BlockHash, block_id: int, token_ids: tuple[int, ...], parent: BlockHash | None,
                keep: Collection[BlockHash] = (), state_row: int = -1, window_pages: tuple[int, ...] = ()) -> None:
        """Keep the contents of device block ``block_id`` in the host pool and, written through, on disk (before
        the block is reused, or before a shutdown); with the snapshot in device state row ``state_row`` (>= 0), or
        the retained window in device window pages ``window_pages``."""
        host, disk = self.host, self.disk
        if host is None:
            return
        resumes = state_row >= 0 or bool(window_pages)
        held = host.get(block_hash)
        if held is not None:
            host.touch(block_hash)  # already there (it was restored from the host): no copy
        elif any(self._wanted(tier, block_hash, resumes) for tier in self.tiers()):  # (the host stages disk writes)
            held = self._add(host, block_hash, token_ids, parent, keep)
            if held is None:
                return
            self.transfers.append(KVTransfer(TransferKind.OFFLOAD, block_id=block_id, host_block=held.index))
        else:
            return
        if resumes and held.state_row < 0 and self._add_state(host, block_hash, keep):
            self.transfers.append(KVTransfer(TransferKind.OFFLOAD_STATE, state_row=state_row,
                                             host_state_row=held.state_row, window_pages=window_pages))
        if disk is not None and block_hash in host:
            self._write_through(disk, held, block_hash, token_ids, parent, keep)
        # A window model's block that stays in neither (a window that found no row) is no use there: dropped (a
        # disk write of it has its host row until it is done)
        self._prune(host, block_hash, keep)

    def _write_through(self, disk: TierIndex, held: TierBlock, block_hash: BlockHash, token_ids: tuple[int, ...],
                       parent: BlockHash | None, keep: Collection[BlockHash]) -> None:
        on_disk, write = disk.get(block_hash), False
        if on_disk is None and self._wanted(disk, block_hash, held.state_row >= 0):
            on_disk = self._add(disk, block_hash, token_ids, parent, keep)
            write = on_disk is not None
        if on_disk is not None and held.state_row >= 0 and on_disk.state_row < 0:
            write |= self._add_state(disk, block_hash, keep)
        if write and block_hash in disk:  # (re)written with the snapshot the host holds, if the disk keeps it
            self.transfers.append(KVTransfer(TransferKind.DISK_WRITE, host_block=held.index, block_hash=block_hash,
                                             parent_hash=parent, token_ids=token_ids,
                                             host_state_row=held.state_row if disk.has_state(block_hash) else -1))
        self._prune(disk, block_hash, keep)

    def _wanted(self, tier: TierIndex, block_hash: BlockHash, resumes: bool) -> bool:
        """Whether ``tier`` takes a block: any block, but a window model's only with its window or as the parent
        of one of the tier's blocks (module docstring)."""
        return not self.windows or resumes or tier.has_children(block_hash)

    def _prune(self, tier: TierIndex, block_hash: BlockHash | None, keep: Collection[BlockHash] = (),
               spare: BlockHash | None = None) -> None:
        """A window model's tier: drop the block if it owns no window row and has no child in the tier (no hit can
        use it), then its parent likewise, and so on; never a block in ``keep`` (an admission reads it) nor
        ``spare``."""
        while self.windows and block_hash is not None and block_hash not in keep and block_hash != spare:
            block = tier.get(block_hash)
            if block is None or block.state_row >= 0 or tier.has_children(block_hash):
                return
            block_hash = self._drop(tier, block_hash)

    def prune(self, block_hashes: Iterable[BlockHash]) -> None:
        """After an admission read these blocks: drop those a window model's tiers could not drop meanwhile."""
        for block_hash in block_hashes:
            for tier in self.tiers():
                self._prune(tier, block_hash)

    def _add_state(self, tier: TierIndex, block_hash: BlockHash, keep: Collection[BlockHash]) -> bool:
        """Give the tier's block its snapshot, making room as the tier does (module docstring). A window model's
        window with one deeper below it and no branch between (its block has one child here, on the way to it: a
        prompt end under its reply end) is the next to go, as on the device."""
        row, victim = tier.add_state(block_hash, keep, dominated=self.windows and tier.children.get(block_hash) == 1)
        if victim is not None:
            if tier is self.disk:  # its file holds the snapshot: the block goes with it
                self._prune(tier, self._drop(tier, victim), keep)
            else:
                dropped = tier.blocks[victim]
                self.events.stored(victim, dropped.parent_hash, dropped.token_ids, tier.medium, snapshot=False)
                self._prune(tier, victim, keep)
        if row is None:
            return False
        block = tier.blocks[block_hash]
        self.events.stored(block_hash, block.parent_hash, block.token_ids, tier.medium, snapshot=True)
        return True

    def _drop(self, tier: TierIndex, block_hash: BlockHash) -> BlockHash | None:
        """Drop a block of the tier; returns its parent's hash."""
        parent = tier.remove(block_hash).parent_hash
        self.events.removed(block_hash, tier.medium)
        if tier is self.disk:
            self.transfers.append(KVTransfer(TransferKind.DISK_DELETE, block_hash=block_hash))
        return parent

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
        for _, dropped_block in dropped:  # (the new block is the caller's to settle)
            self._prune(tier, dropped_block.parent_hash, keep, spare=block_hash)
        return block

    def usable(self, tier: TierIndex, block_hash: BlockHash) -> bool:
        """Whether an admission can restore this block; a disk block whose file cannot be read or fails its
        checksum is dropped instead (a miss: the block is recomputed), its file deleted."""
        if tier is not self.disk or self.disk_reader is None or self.disk_reader(block_hash):
            return True
        self._prune(self.disk, self._drop(self.disk, block_hash))
        return False

    def restore(self, tier: TierIndex, block_hash: BlockHash, block_id: int, state_row: int = -1,
                window_pages: tuple[int, ...] = ()) -> None:
        """Copy a lower-tier block into device block ``block_id`` (-1: not its pages) and its snapshot into device
        state row ``state_row`` or its window into device window pages ``window_pages`` (neither: not those),
        before the step's forward reads them."""
        tier.touch(block_hash)
        if tier is self.disk:
            self.transfers.append(KVTransfer(TransferKind.DISK_READ, block_id=block_id, block_hash=block_hash,
                                             state_row=state_row, window_pages=window_pages))
            return
        block = tier.blocks[block_hash]
        if block_id >= 0:
            self.transfers.append(KVTransfer(TransferKind.RESTORE, block_id=block_id, host_block=block.index))
        if state_row >= 0 or window_pages:
            self.transfers.append(KVTransfer(TransferKind.RESTORE_STATE, state_row=state_row,
                                             host_state_row=block.state_row, window_pages=window_pages))

    def load_disk(self, blocks: Iterable[FoundBlock]) -> int:
        """Index the block files a previous run left (oldest first); the oldest beyond the tier's size are deleted
        (a restart with a smaller tier keeps to it), and a window model's blocks no window can use. Returns how
        many were kept."""
        if self.disk is None:
            return 0
        taken, left = self.disk.load(blocks)
        for block_hash in taken:
            block = self.disk.blocks[block_hash]
            self.events.stored(block_hash, block.parent_hash, block.token_ids, MEDIUM_DISK,
                               snapshot=block.state_row >= 0)
        self.transfers += [KVTransfer(TransferKind.DISK_DELETE, block_hash=h) for h in left]
        for block_hash in taken:
            self._prune(self.disk, block_hash)
        return len(self.disk)

    def clear(self) -> None:
        for tier in self.tiers():
            for block_hash in tier.clear():
                self.events.removed(block_hash, tier.medium)
        if self.disk is not None:
            self.transfers.append(KVTransfer(TransferKind.DISK_CLEAR))

    def take_transfers(self) -> list[KVTransfer]:
        transfers, self.transfers = self.transfers, []
        return transfers
