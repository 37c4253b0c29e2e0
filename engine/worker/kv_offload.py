"""The model runner's side of the KV tiers: the host pool's buffers and the disk store, and the copies the
scheduler asks for (`KVTransfer`s, in order, before each step's forward).

On CUDA the copies run on a side stream into pinned host memory: the side stream first waits for the work already
queued on the compute stream (a block is offloaded only after the step that wrote it), and the compute stream waits
for the side stream before the forward (a restored block is there before anything reads it). On CPU the copies are
plain and run where the step's device part runs, in step order. Disk writes happen on a writer thread from the host
block just filled; a later copy into that host block, or a read of that block's file, waits for the write.

A disk block is read when admission wants it (`read_disk_block`, called by the KV manager), not when the step copies
it: a block whose file fails its checksum or cannot be read is then a miss, dropped and recomputed, and no step
ever fails on it. The payload waits in memory until the step's copy takes it.

Hybrid models: the host pool also has *state rows* (one snapshot each: every recurrent layer's conv window and
delta-rule state), and a block file may end with its block's snapshot after the pages (the file's header says how
many bytes; the checksum covers both). Sliding-window models: a state row is a retained window, ``pages_per_row``
pages of every window layer (the most a resume reads; a window near the start fills fewer, from the row's first),
copied from and to the device window pages a transfer names; a block file may end with it likewise.
"""
from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from engine.worker.kv_disk import DiskBlockError, DiskStore
from engine.outputs import KVTransfer, TransferKind

log = logging.getLogger(__name__)
_READ_AHEAD_BLOCKS = 4096  # disk payloads read for admissions whose copies have not run yet


@dataclass
class TransferStats:
    offload_bytes: int = 0
    restore_bytes: int = 0  # host -> device
    disk_write_bytes: int = 0
    disk_read_bytes: int = 0
    restore_s: float = 0.0  # copying hits back (host and disk); on CUDA measured with events when they completed
    _pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = field(default_factory=list, repr=False)

    def settle(self) -> None:
        """Add the GPU time of restores whose events completed."""
        done = [p for p in self._pending if p[1].query()]
        self._pending = [p for p in self._pending if not p[1].query()]
        self.restore_s += sum(start.elapsed_time(end) for start, end in done) / 1e3


def flat_caches(kv_caches: list) -> list[torch.Tensor]:
    """Every per-layer cache tensor (K and V, or one latent; a conv window and a delta-rule state), each indexed by
    block (or state row) on dim 0."""
    return [t for layer in kv_caches for t in (layer if isinstance(layer, (tuple, list)) else (layer,))]


def state_row_shape(tensor: torch.Tensor, pages_per_row: int = 0) -> tuple[int, ...]:
    """The shape of a tier's state row of ``tensor``: one row of it, or ``pages_per_row`` pages (a window's)."""
    return (pages_per_row, *tensor.shape[1:]) if pages_per_row else tuple(tensor.shape[1:])


def row_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of one row (a block, or a state row) across ``tensors``."""
    return sum(t[0].numel() * t.element_size() for t in tensors)


def _device_rows(t: KVTransfer) -> int | list[int]:
    """The device side of a state copy: a hybrid's state row, or a window's pages."""
    return list(t.window_pages) if t.window_pages else t.state_row


def _rows_of(row: torch.Tensor, rows: int | list[int]) -> torch.Tensor:
    """The part of a tier's state row that ``rows`` fill: all of a snapshot's, a window's first ``len(rows)`` pages."""
    return row if isinstance(rows, int) else row[: len(rows)]


def _put(device: torch.Tensor, rows: int | list[int], values: torch.Tensor, non_blocking: bool) -> None:
    if isinstance(rows, int):
        device[rows].copy_(values, non_blocking=non_blocking)
    else:
        device[rows] = values.to(device.device, non_blocking=non_blocking)


class KVOffload:
    def __init__(self, kv_caches: list, host_blocks: int, disk: DiskStore | None = None, state_layers: list = (),
                 host_state_rows: int = 0, pages_per_row: int = 0) -> None:
        """``state_layers``: a hybrid model's recurrent layers' state tensors (indexed by state row), of which
        the host keeps ``host_state_rows`` snapshots; or (``pages_per_row`` > 0) a sliding-window model's window
        layers' page tensors, of which a host row keeps that many pages (a retained window)."""
        self.device_tensors = flat_caches(kv_caches)
        self.device_states = flat_caches(state_layers)
        first = self.device_tensors[0]
        self.on_cuda = first.device.type == "cuda"
        pin = self.on_cuda
        self.host_tensors = [torch.zeros((host_blocks, *t.shape[1:]), dtype=t.dtype, pin_memory=pin)
                             for t in self.device_tensors]
        self.state_shapes = [state_row_shape(t, pages_per_row) for t in self.device_states]
        self.host_states = [torch.zeros((host_state_rows, *shape), dtype=t.dtype, pin_memory=pin)
                            for t, shape in zip(self.device_states, self.state_shapes)]
        self.bytes_per_block = row_bytes(self.device_tensors)
        self.bytes_per_state = row_bytes(self.device_states) * max(1, pages_per_row)
        self.disk = disk
        self.stats = TransferStats()
        self._stream = torch.cuda.Stream(first.device) if self.on_cuda else None
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kvserve-kv-disk") if disk is not None else None
        self._host_block_reads: dict[int, Future] = {}  # host block -> the disk write still reading it
        self._state_reads: dict[int, Future] = {}  # host state row -> the disk write still reading it
        self._file_writes: dict[bytes, Future] = {}  # block hash -> its pending disk write
        self._read_ahead: OrderedDict[bytes, bytes] = OrderedDict()  # block hash -> payload admission checked

    @staticmethod
    def tier_capacity(gb: float, bytes_per_block: int, bytes_per_state: int = 0,
                      state_fraction: float = 0.0) -> tuple[int, int]:
        """(blocks, snapshots) a tier of ``gb`` GiB holds; a hybrid model's snapshots take ``state_fraction`` of
        it, as in the device pool."""
        total = int(gb * 2**30)
        states = int(total * state_fraction) // bytes_per_state if bytes_per_state else 0
        return (total - states * bytes_per_state) // bytes_per_block, states

    def disk_capacity(self, gb: float, state_fraction: float) -> tuple[int, int]:
        """(blocks, snapshots) of the disk tier: a snapshot's file holds its block's pages too."""
        return self.tier_capacity(gb, self.bytes_per_block, self.bytes_per_state, state_fraction)

    def run(self, transfers: list[KVTransfer]) -> None:
        """Perform a step's copies in order, before its forward."""
        if not transfers:
            return
        if self._stream is None:
            for transfer in transfers:
                self._one(transfer)
            return
        compute = torch.cuda.current_stream(self._stream.device)
        self._stream.wait_stream(compute)
        with torch.cuda.stream(self._stream):
            for transfer in transfers:
                self._one(transfer)
        compute.wait_stream(self._stream)

    def _one(self, t: KVTransfer) -> None:
        kind = t.kind
        if kind is TransferKind.OFFLOAD:
            self._offload(self._host_block_reads, self.device_tensors, self.host_tensors, t.block_id, t.host_block)
            self.stats.offload_bytes += self.bytes_per_block
        elif kind is TransferKind.RESTORE:
            self._restore(self.device_tensors, self.host_tensors, t.block_id, t.host_block)
            self.stats.restore_bytes += self.bytes_per_block
        elif kind is TransferKind.OFFLOAD_STATE:
            self._offload(self._state_reads, self.device_states, self.host_states, _device_rows(t), t.host_state_row)
            self.stats.offload_bytes += self.bytes_per_state
        elif kind is TransferKind.RESTORE_STATE:
            self._restore(self.device_states, self.host_states, _device_rows(t), t.host_state_row)
            self.stats.restore_bytes += self.bytes_per_state
        elif kind is TransferKind.DISK_WRITE:
            written = self._stream.record_event() if self._stream is not None else None
            future = self._writer.submit(self._write_file, t, written)
            if len(self._file_writes) > 1024:  # forget writes that are done
                self._file_writes = {h: f for h, f in self._file_writes.items() if not f.done()}
            self._host_block_reads[t.host_block] = self._file_writes[t.block_hash] = future
            if t.host_state_row >= 0:
                self._state_reads[t.host_state_row] = future
            self.stats.disk_write_bytes += self.bytes_per_block + (self.bytes_per_state if t.host_state_row >= 0 else 0)
        elif kind is TransferKind.DISK_READ:
            payload = self._read_ahead.pop(t.block_hash, None)
            if payload is None:
                self._wait(self._file_writes.pop(t.block_hash, None))
                payload = self.disk.read(t.block_hash)
            pages, state = payload[: self.bytes_per_block], payload[self.bytes_per_block:]
            if t.block_id >= 0:
                self._timed(lambda: self._load_payload(pages, self.device_tensors, t.block_id))
                self.stats.disk_read_bytes += len(pages)
            if t.state_row >= 0 or t.window_pages:
                self._timed(lambda: self._load_payload(state, self.device_states, _device_rows(t), self.state_shapes))
                self.stats.disk_read_bytes += len(state)
        elif kind is TransferKind.DISK_DELETE:
            self._writer.submit(self.disk.delete, t.block_hash)
        elif kind is TransferKind.DISK_CLEAR:
            self._writer.submit(self.disk.clear)

    def _offload(self, reads: dict[int, Future], device: list[torch.Tensor], host: list[torch.Tensor],
                 src: int | list[int], dst: int) -> None:
        """Row ``src`` of the device tensors (or rows, a window's pages) into host row ``dst``, once no disk write
        still reads that row."""
        self._wait(reads.pop(dst, None))
        for dev, hst in zip(device, host):
            _rows_of(hst[dst], src).copy_(dev[src], non_blocking=self.on_cuda)

    def _restore(self, device: list[torch.Tensor], host: list[torch.Tensor], dst: int | list[int], src: int) -> None:
        self._timed(lambda: [_put(dev, dst, _rows_of(hst[src], dst), self.on_cuda) for dev, hst in zip(device, host)])

    def read_disk_block(self, block_hash: bytes) -> bool:
        """Read and check a disk block that admission is about to restore; False (logged) when its file fails its
        checksum or cannot be read: then it is a miss. The payload waits for the step's `DISK_READ`."""
        if block_hash in self._read_ahead:
            return True
        self._wait(self._file_writes.pop(block_hash, None))
        try:
            payload = self.disk.read(block_hash)
        except DiskBlockError as exc:
            log.warning("KV disk tier: %s; recomputing the block instead", exc)
            return False
        self._read_ahead[block_hash] = payload
        while len(self._read_ahead) > _READ_AHEAD_BLOCKS:  # admissions that never came back for theirs
            self._read_ahead.popitem(last=False)
        return True

    def _write_file(self, t: KVTransfer, written: torch.cuda.Event | None) -> None:
        if written is not None:
            written.synchronize()  # the offload into this host block has landed
        rows = [host[t.host_block] for host in self.host_tensors]
        if t.host_state_row >= 0:  # the block's snapshot follows its pages
            rows += [host[t.host_state_row] for host in self.host_states]
        payload = b"".join(row.reshape(-1).view(torch.uint8).numpy().tobytes() for row in rows)
        try:
            self.disk.write(t.block_hash, t.parent_hash, t.token_ids, payload,
                            state_bytes=self.bytes_per_state if t.host_state_row >= 0 else 0)
        except OSError:  # a full or broken disk must not stop serving; a later hit on this block fails its step
            log.exception("could not write KV block %s to disk", t.block_hash.hex())

    def _load_payload(self, payload: bytes, tensors: list[torch.Tensor], row: int | list[int],
                      shapes: list[tuple[int, ...]] | None = None) -> None:
        """Row ``row`` (or rows: a window's pages) of every tensor in ``tensors`` from ``payload`` (their rows one
        after another, each of its ``shapes`` entry: one row by default)."""
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        offset = 0
        for i, dev in enumerate(tensors):
            shape = shapes[i] if shapes is not None else dev.shape[1:]
            size = math.prod(shape) * dev.element_size()
            block = _rows_of(data[offset : offset + size].view(dev.dtype).view(shape), row)
            _put(dev, row, block.pin_memory() if self.on_cuda else block, self.on_cuda)
            offset += size

    def _timed(self, copy) -> None:
        if self._stream is None:
            start = time.perf_counter()
            copy()
            self.stats.restore_s += time.perf_counter() - start
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(self._stream)
        copy()
        end.record(self._stream)
        self.stats._pending.append((start, end))

    @staticmethod
    def _wait(future: Future | None) -> None:
        if future is not None:
            future.result()

    def flush(self) -> None:
        """Wait for every queued disk operation (tests, shutdown)."""
        if self._writer is not None:
            self._writer.submit(lambda: None).result()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.shutdown(wait=True)
