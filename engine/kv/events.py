"""KV cache events in vLLM's wire format, for cache-aware routers (vLLM's router `kv_aware` policy, NVIDIA Dynamo's
KV indexer, llm-d's precise prefix scorer) that learn each replica's cache from them.

The KV manager records `BlockStored` / `BlockRemoved` / `AllBlocksCleared` as it changes (per tier: ``medium``
"GPU" for the device pool, "CPU" for the host pool, "DISK" for the disk tier); after each engine step the
`KVEventPublisher` sends them as one batch on a ZMQ PUB socket, as vLLM's ``ZmqEventPublisher`` does:

    multipart [topic, seq (uint64 big-endian), msgpack EventBatch]
    EventBatch = [ts (float seconds), [event, ...], data_parallel_rank (0)]
    event      = {"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids", "block_size",
                  "lora_id" (nil), "medium", "lora_name" (nil)}
               | {"type": "BlockRemoved", "block_hashes", "medium"}
               | {"type": "AllBlocksCleared"}

Events are maps tagged by ``type``, as vLLM's msgspec structs (``tag=True``) encode them: vLLM's router decodes
only that form, Dynamo's decoder takes it as well as the older tagged arrays. Block hashes go out as unsigned
64-bit integers: the first 8 bytes (big-endian) of kvserve's 128-bit chained block hash (`external_block_hash`).
A ROUTER replay socket serves missed batches: a client sends ``[b"", start_seq]`` (8 bytes big-endian; a REQ
socket adds the empty frame itself) and receives ``[b"", topic, seq, payload]`` for every buffered batch from
``start_seq`` on, then ``[b"", b"", -1 (8 bytes, signed), b""]``, as vLLM's publisher answers.

The event types here are plain data (the KV manager imports them); zmq and msgpack load only with a publisher.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Union

from engine.kv.block_hashing import BlockHash

log = logging.getLogger(__name__)

MEDIUM_DEVICE = "GPU"  # vLLM's name for the engine's own pool (also on CPU-only kvserve: it is the primary pool)
MEDIUM_HOST = "CPU"
MEDIUM_DISK = "DISK"
END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass
class BlockStored:
    block_hashes: list[BlockHash]  # a chain: each block the child of the one before, the first of parent_block_hash
    parent_block_hash: BlockHash | None
    token_ids: list[int]  # every block's tokens, concatenated
    medium: str
    # Hybrid models: which of these blocks carry a recurrent-state snapshot in this medium (None: not a hybrid)
    snapshot_hashes: list[BlockHash] | None = None


@dataclass
class BlockRemoved:
    block_hashes: list[BlockHash]
    medium: str


@dataclass
class AllBlocksCleared:
    pass


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


def external_block_hash(block_hash: BlockHash) -> int:
    """The 64-bit form routers take (Dynamo reads block hashes as u64)."""
    return int.from_bytes(block_hash[:8], "big")


def wire_event(event: KVEvent, block_size: int, token_ids: bool = True) -> dict[str, Any]:
    """One event as vLLM's msgspec encodes it: a map tagged with ``type``, fields named as vLLM names them.
    ``token_ids`` False: a stored block's tokens go out empty (block hashes only)."""
    if isinstance(event, BlockStored):
        parent = None if event.parent_block_hash is None else external_block_hash(event.parent_block_hash)
        wire = {"type": "BlockStored", "block_hashes": [external_block_hash(h) for h in event.block_hashes],
                "parent_block_hash": parent, "token_ids": list(event.token_ids) if token_ids else [],
                "block_size": block_size,
                "lora_id": None, "medium": event.medium, "lora_name": None}
        if event.snapshot_hashes is not None:  # a key vLLM's decoders skip (docs/HYBRID_CACHE.md)
            wire["state_snapshots"] = [external_block_hash(h) for h in event.snapshot_hashes]
        return wire
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": [external_block_hash(h) for h in event.block_hashes],
                "medium": event.medium}
    return {"type": "AllBlocksCleared"}


@dataclass
class EventRecorder:
    """Where the KV manager writes its events; consecutive ones of a kind merge (a chain stored block by block
    becomes one `BlockStored`).

    ``snapshots``: a hybrid model. Every `BlockStored` then lists which of its blocks carry a recurrent-state
    snapshot in that medium, and a snapshot arriving at or leaving a block the medium already holds is a
    `BlockStored` of that block again, saying whether it has one now (to a reader that knows nothing of
    snapshots, a repeated store of a block it holds)."""

    enabled: bool = False
    events: list[KVEvent] = field(default_factory=list)
    snapshots: bool = False

    def stored(self, block_hash: BlockHash, parent: BlockHash | None, token_ids: tuple[int, ...], medium: str,
               snapshot: bool = False) -> None:
        if not self.enabled:
            return
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockStored) and last.medium == medium and last.block_hashes[-1] == block_hash:
            _flag(last, block_hash, snapshot)  # the block just announced: only its snapshot changed
        elif isinstance(last, BlockStored) and last.medium == medium and last.block_hashes[-1] == parent:
            last.block_hashes.append(block_hash)
            last.token_ids.extend(token_ids)
            _flag(last, block_hash, snapshot)
        else:
            event = BlockStored([block_hash], parent, list(token_ids), medium, [] if self.snapshots else None)
            _flag(event, block_hash, snapshot)
            self.events.append(event)

    def removed(self, block_hash: BlockHash, medium: str) -> None:
        if not self.enabled:
            return
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockRemoved) and last.medium == medium:
            last.block_hashes.append(block_hash)
        else:
            self.events.append(BlockRemoved([block_hash], medium))

    def cleared(self, since: int) -> None:
        """Everything is gone: the events since index ``since`` collapse into one `AllBlocksCleared`."""
        if self.enabled:
            del self.events[since:]
            self.events.append(AllBlocksCleared())

    def take(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events


def _flag(event: BlockStored, block_hash: BlockHash, snapshot: bool) -> None:
    if event.snapshot_hashes is None:
        return
    if snapshot and block_hash not in event.snapshot_hashes:
        event.snapshot_hashes.append(block_hash)
    elif not snapshot and block_hash in event.snapshot_hashes:
        event.snapshot_hashes.remove(block_hash)


class KVEventPublisher:
    """vLLM's ZMQ publisher protocol: a PUB socket for the stream, an optional ROUTER socket replaying the last
    ``buffer_steps`` batches. Sending runs on its own thread, so a slow subscriber never holds up a step.

    The PUB socket is an XPUB (the same stream, plus subscription notices): while the process has published
    nothing, a subscriber's arrival is answered with ``AllBlocksCleared`` as batch 0. A replica restarted on the
    same ports is thereby announced the moment a router's subscriber reconnects, before it serves again: the
    router drops the dead process's blocks then, not when the new process first stores one, and credits it with
    nothing it lost in between.

    An endpoint with ``*`` (or ``ipc://`` / ``inproc://``) is bound, any other is connected to, as vLLM does; but a
    ``*`` binds 127.0.0.1 unless ``all_interfaces``: the stream and the replay socket have no access control, and
    the events describe every tenant's blocks (``token_ids`` False leaves their token ids out)."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "", block_size: int = 16,
                 buffer_steps: int = 10_000, data_parallel_rank: int = 0, all_interfaces: bool = False,
                 token_ids: bool = True) -> None:
        import msgpack
        import zmq

        replay_bind = _local_unless(replay_endpoint, all_interfaces) if replay_endpoint else None  # before any socket
        self._pack = msgpack.Packer(use_bin_type=True).pack
        self.block_size = block_size
        self.topic = topic.encode()
        self.data_parallel_rank = data_parallel_rank
        self.token_ids = token_ids
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        _bind_or_connect(self._pub, endpoint, all_interfaces)
        self._replay = None
        if replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(replay_bind)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._queue: queue.SimpleQueue[list[KVEvent] | None] = queue.SimpleQueue()
        self._next_seq = 0
        self._thread = threading.Thread(target=self._run, name="kvserve-kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[KVEvent]) -> None:
        """Queue one step's events as a batch (nothing is sent for an empty step)."""
        if events:
            self._queue.put(events)

    def close(self, timeout: float = 2.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout)
        self._pub.close()
        if self._replay is not None:
            self._replay.close()

    def _run(self) -> None:
        while True:
            while self._pub.poll(0):
                self._on_subscription(self._pub.recv())
            if self._replay is not None:
                while self._replay.poll(0):
                    self._serve_replay()
            try:
                events = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if events is None:
                return
            self._send(events)

    def _send(self, events: list[KVEvent]) -> None:
        batch = [time.time(), [wire_event(e, self.block_size, self.token_ids) for e in events],
                 self.data_parallel_rank]
        payload = self._pack(batch)
        seq = self._next_seq
        self._next_seq += 1
        self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        self._buffer.append((seq, payload))

    def _on_subscription(self, notice: bytes) -> None:
        """XPUB notices are b"\x01" + topic (subscribe) or b"\x00" + topic (unsubscribe)."""
        if notice[:1] == b"\x01" and self._next_seq == 0:
            self._send([AllBlocksCleared()])

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("ignoring a malformed KV event replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart([client, b"", self.topic, seq.to_bytes(8, "big"), payload])
        self._replay.send_multipart([client, b"", b"", END_SEQ, b""])


_WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "[::]", "")
_LOOPBACK_HOSTS = ("localhost", "::1", "[::1]")


def _local_unless(endpoint: str, all_interfaces: bool) -> str:
    """A TCP endpoint to bind, loopback unless every interface is asked for: a wildcard host (``*``, ``0.0.0.0``,
    ``::``) becomes 127.0.0.1, and any other host that is not loopback (an address, an interface name) is refused
    with a ValueError naming the flag."""
    if all_interfaces or not endpoint.startswith("tcp://"):
        return endpoint
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    if host in _WILDCARD_HOSTS:
        local = f"tcp://127.0.0.1:{port}"
        log.info("KV events: binding %s as %s (--kv-events-all-interfaces binds every interface)", endpoint, local)
        return local
    if host in _LOOPBACK_HOSTS or host.startswith("127."):
        return endpoint
    raise ValueError(f"KV events: binding {endpoint} would listen beyond this machine, and the events and their replay "
                     "have no access control; bind a loopback or wildcard address (served on 127.0.0.1), or pass "
                     "--kv-events-all-interfaces")


def _bind_or_connect(socket: Any, endpoint: str, all_interfaces: bool = False) -> None:
    if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
        socket.bind(_local_unless(endpoint, all_interfaces))
    else:
        socket.connect(endpoint)
