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
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from engine.kv_disk import DiskBlockError, DiskStore
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
    """Every per-layer cache tensor (K and V, or one latent), each indexed by block on dim 0."""
    return [t for layer in kv_caches for t in (layer if isinstance(layer, (tuple, list)) else (layer,))]


class KVOffload:
    def __init__(self, kv_caches: list, host_blocks: int, disk: DiskStore | None = None) -> None:
        self.device_tensors = flat_caches(kv_caches)
        first = self.device_tensors[0]
        self.on_cuda = first.device.type == "cuda"
        pin = self.on_cuda
        self.host_tensors = [torch.zeros((host_blocks, *t.shape[1:]), dtype=t.dtype, pin_memory=pin)
                             for t in self.device_tensors]
        self.bytes_per_block = sum(t[0].numel() * t.element_size() for t in self.device_tensors)
        self.disk = disk
        self.stats = TransferStats()
        self._stream = torch.cuda.Stream(first.device) if self.on_cuda else None
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kvserve-kv-disk") if disk is not None else None
        self._host_block_reads: dict[int, Future] = {}  # host block -> the disk write still reading it
        self._file_writes: dict[bytes, Future] = {}  # block hash -> its pending disk write
        self._read_ahead: OrderedDict[bytes, bytes] = OrderedDict()  # block hash -> payload admission checked

    @staticmethod
    def host_blocks_for(gb: float, bytes_per_block: int) -> int:
        return int(gb * 2**30) // bytes_per_block

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
            self._wait(self._host_block_reads.pop(t.host_block, None))
            for dev, host in zip(self.device_tensors, self.host_tensors):
                host[t.host_block].copy_(dev[t.block_id], non_blocking=self.on_cuda)
            self.stats.offload_bytes += self.bytes_per_block
        elif kind is TransferKind.RESTORE:
            self._timed(lambda: [dev[t.block_id].copy_(host[t.host_block], non_blocking=self.on_cuda)
                                 for dev, host in zip(self.device_tensors, self.host_tensors)])
            self.stats.restore_bytes += self.bytes_per_block
        elif kind is TransferKind.DISK_WRITE:
            written = self._stream.record_event() if self._stream is not None else None
            future = self._writer.submit(self._write_file, t, written)
            if len(self._file_writes) > 1024:  # forget writes that are done
                self._file_writes = {h: f for h, f in self._file_writes.items() if not f.done()}
            self._host_block_reads[t.host_block] = self._file_writes[t.block_hash] = future
            self.stats.disk_write_bytes += self.bytes_per_block
        elif kind is TransferKind.DISK_READ:
            payload = self._read_ahead.pop(t.block_hash, None)
            if payload is None:
                self._wait(self._file_writes.pop(t.block_hash, None))
                payload = self.disk.read(t.block_hash)
            self._timed(lambda: self._load_payload(payload, t.block_id))
            self.stats.disk_read_bytes += self.bytes_per_block
        elif kind is TransferKind.DISK_DELETE:
            self._writer.submit(self.disk.delete, t.block_hash)
        elif kind is TransferKind.DISK_CLEAR:
            self._writer.submit(self.disk.clear)

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
        payload = b"".join(host[t.host_block].reshape(-1).view(torch.uint8).numpy().tobytes() for host in self.host_tensors)
        try:
            self.disk.write(t.block_hash, t.parent_hash, t.token_ids, payload)
        except OSError:  # a full or broken disk must not stop serving; a later hit on this block fails its step
            log.exception("could not write KV block %s to disk", t.block_hash.hex())

    def _load_payload(self, payload: bytes, block_id: int) -> None:
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        offset = 0
        for dev in self.device_tensors:
            size = dev[0].numel() * dev.element_size()
            block = data[offset : offset + size].view(dev.dtype).view(dev.shape[1:])
            dev[block_id].copy_(block.pin_memory() if self.on_cuda else block, non_blocking=self.on_cuda)
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
