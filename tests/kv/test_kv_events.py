"""KV events on the wire: a ZMQ subscriber that joins late, replays what it missed from the replay socket, and then
follows the stream reconstructs exactly the blocks the KV manager holds in every tier, across evictions, offloads,
restores and a reset; sequence numbers strictly increase. For a hybrid model also which blocks carry a
recurrent-state snapshot in each tier (the ``state_snapshots`` key)."""
from __future__ import annotations

import socket
import time

import msgpack
import pytest
import zmq

from engine import LLM, SamplingParams
from engine.kv.events import END_SEQ, external_block_hash
from tests.hf_oracle import random_prompts

BLOCK = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Subscriber:
    """A router's view of one replica: SUB on the stream, DEALER on the replay socket, per-tier block sets."""

    def __init__(self, port: int, replay_port: int) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.connect(f"tcp://127.0.0.1:{port}")
        self.sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        self.replay = self.ctx.socket(zmq.DEALER)
        self.replay.connect(f"tcp://127.0.0.1:{replay_port}")
        self.last_seq = -1
        self.seqs: list[int] = []
        self.replayed = 0
        self.tiers: dict[str, set[int]] = {}
        self.snapshots: dict[str, set[int]] = {}  # hybrid models: the blocks with a snapshot, per tier

    def apply(self, seq: int, payload: bytes) -> None:
        assert seq == self.last_seq + 1, f"batch {seq} after {self.last_seq}"
        self.last_seq = seq
        self.seqs.append(seq)
        ts, events, rank = msgpack.unpackb(payload, raw=False)
        assert isinstance(ts, float) and rank == 0
        for event in events:
            kind = event["type"]
            if kind == "BlockStored":
                hashes, tokens, medium = event["block_hashes"], event["token_ids"], event["medium"]
                assert event["block_size"] == BLOCK and len(tokens) == len(hashes) * BLOCK
                assert event["lora_id"] is None and event["lora_name"] is None
                assert all(isinstance(h, int) and 0 <= h < 2**64 for h in hashes)
                held = self.tiers.setdefault(medium, set())
                if "state_snapshots" in event:  # a hybrid model: a repeated store updates the block's snapshot
                    flagged = self.snapshots.setdefault(medium, set())
                    flagged.difference_update(hashes)
                    flagged.update(event["state_snapshots"])
                else:
                    assert not held & set(hashes)
                held.update(hashes)
            elif kind == "BlockRemoved":
                hashes, medium = event["block_hashes"], event["medium"]
                assert set(hashes) <= self.tiers.get(medium, set())
                self.tiers[medium].difference_update(hashes)
                self.snapshots.get(medium, set()).difference_update(hashes)
            else:
                assert event == {"type": "AllBlocksCleared"}
                self.tiers.clear()
                self.snapshots.clear()

    def catch_up(self, missing_from: int) -> None:
        self.replay.send_multipart([b"", missing_from.to_bytes(8, "big")])
        while True:
            assert self.replay.poll(5000), "no replay answer"
            _, topic, seq_bytes, payload = self.replay.recv_multipart()
            if seq_bytes == END_SEQ:
                assert topic == payload == b""
                return
            assert topic == b"kv"
            seq = int.from_bytes(seq_bytes, "big")
            if seq > self.last_seq:
                self.apply(seq, payload)
                self.replayed += 1

    def drain(self, until_seq: int, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while self.last_seq < until_seq:
            assert time.monotonic() < deadline, f"stuck at batch {self.last_seq} of {until_seq}"
            if not self.sub.poll(1000):  # nothing new: the batches before it may have gone out before the SUB socket
                self.catch_up(self.last_seq + 1)  # joined (ZMQ's slow joiner), so ask the replay socket, as a client would
                continue
            topic, seq_bytes, payload = self.sub.recv_multipart()
            assert topic == b"kv"
            seq = int.from_bytes(seq_bytes, "big")
            if seq <= self.last_seq:
                continue  # already replayed
            if seq > self.last_seq + 1:
                self.catch_up(self.last_seq + 1)
            if seq == self.last_seq + 1:
                self.apply(seq, payload)

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def published(llm: LLM) -> int:
    """The last sequence number the publisher sent, once its queue drained."""
    publisher = llm.engine.kv_events
    deadline = time.monotonic() + 10
    while not publisher._queue.empty():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.1)
    return publisher._next_seq - 1


def manager_sets(llm: LLM) -> dict[str, set[int]]:
    kv = llm.engine.scheduler.kv  # between generate calls no engine thread runs
    sets = {"GPU": set(kv.by_hash)} | {t.medium: set(t.blocks) for t in kv.tiers.tiers()}
    return {medium: {external_block_hash(h) for h in hashes} for medium, hashes in sets.items()}


def manager_snapshots(llm: LLM) -> dict[str, set[int]]:
    kv = llm.engine.scheduler.kv
    sets = {"GPU": {h for h, n in kv.by_hash.items() if n.snapshot_row >= 0}}
    sets |= {t.medium: set(t.states) for t in kv.tiers.tiers()}
    return {medium: {external_block_hash(h) for h in hashes} for medium, hashes in sets.items()}


def nonempty(tiers: dict[str, set[int]]) -> dict[str, set[int]]:
    return {medium: held for medium, held in tiers.items() if held}


@pytest.mark.slow
def test_late_subscriber_replays_and_tracks_every_tier(tmp_path):
    port, replay_port = free_port(), free_port()
    llm = LLM("qwen3-tiny", block_size=BLOCK, num_kv_blocks=64, kv_offload_gb=0.01, kv_disk_dir=str(tmp_path),
              kv_events_endpoint=f"tcp://*:{port}", kv_events_replay_endpoint=f"tcp://*:{replay_port}",
              kv_events_topic="kv")
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    a, b, c = random_prompts(llm.engine.model_cfg.vocab_size, [640, 720, 300], seed=3)
    sub = None
    try:
        llm.generate([a], params)  # nobody listens yet: these batches are only in the replay buffer
        sub = Subscriber(port, replay_port)
        time.sleep(0.3)  # let the subscription reach the publisher
        for prompt in (b, a, [*a[:200], *c]):  # evictions to the host and disk, then restores
            llm.generate([prompt], params)
            sub.drain(published(llm))
            assert nonempty(sub.tiers) == nonempty(manager_sets(llm))
        assert sub.replayed > 0 and sub.seqs == sorted(set(sub.seqs)) == list(range(len(sub.seqs)))
        stats = llm.stats
        assert stats.prefix_cache_host_hits_tokens + stats.prefix_cache_disk_hits_tokens > 0
        assert {"GPU", "CPU", "DISK"} <= set(sub.tiers)
        llm.reset_prefix_cache()
        sub.drain(published(llm))
        assert nonempty(sub.tiers) == nonempty(manager_sets(llm)) == {}
    finally:
        if sub is not None:
            sub.close()
        llm.close()


@pytest.mark.slow
def test_a_hybrid_models_events_say_where_its_snapshots_are(hybrid_dirs, tmp_path):
    """Qwen3.5-shaped hybrid: snapshots taken, evicted to the host with their blocks and on to disk, restored; the
    subscriber's blocks and snapshots per tier equal the manager's after every request."""
    port, replay_port = free_port(), free_port()
    llm = LLM(hybrid_dirs["qwen3_5"], block_size=BLOCK, num_kv_blocks=24, max_num_seqs=2, num_state_snapshots=2,
              kv_offload_gb=0.002, kv_disk_dir=str(tmp_path), kv_events_endpoint=f"tcp://*:{port}",
              kv_events_replay_endpoint=f"tcp://*:{replay_port}", kv_events_topic="kv")
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    a, b = random_prompts(llm.engine.model_cfg.vocab_size, [200, 240], seed=4)
    sub = Subscriber(port, replay_port)
    try:
        for prompt in (a, b, a, [*a[:100], *b[:50]]):
            llm.generate([prompt], params)
            sub.drain(published(llm))
            assert nonempty(sub.tiers) == nonempty(manager_sets(llm))
            assert nonempty(sub.snapshots) == nonempty(manager_snapshots(llm))
        assert {"GPU", "CPU", "DISK"} <= set(nonempty(sub.snapshots))
        assert llm.stats.prefix_cache_host_hits_tokens > 0
    finally:
        sub.close()
        llm.close()


@pytest.mark.slow
def test_malformed_replay_request_is_ignored():
    port, replay_port = free_port(), free_port()
    llm = LLM("qwen3-tiny", block_size=BLOCK, num_kv_blocks=64, kv_events_endpoint=f"tcp://*:{port}",
              kv_events_replay_endpoint=f"tcp://*:{replay_port}")
    ctx = zmq.Context()
    try:
        llm.generate([list(range(100, 140))], SamplingParams(max_tokens=2, temperature=0.0))
        replay = ctx.socket(zmq.DEALER)
        replay.connect(f"tcp://127.0.0.1:{replay_port}")
        replay.send_multipart([b"", b"x", b"y"])  # four frames at the ROUTER: ignored
        replay.send_multipart([b"", (0).to_bytes(8, "big")])
        assert replay.poll(5000)
        frames = replay.recv_multipart()
        assert frames[2] == (0).to_bytes(8, "big") and msgpack.unpackb(frames[3])[1]
    finally:
        ctx.destroy(linger=0)
        llm.close()


def test_an_endpoint_without_a_wildcard_is_connected_to():
    """Given a plain address, the publisher connects to it, as vLLM's does: a subscriber that bound that address
    (before or after) hears the publisher's first batch."""
    from engine.kv.events import KVEventPublisher

    port = free_port()
    publisher = KVEventPublisher(f"tcp://127.0.0.1:{port}", topic="kv", block_size=BLOCK)  # nothing listens yet
    ctx = zmq.Context()
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        sub.bind(f"tcp://127.0.0.1:{port}")
        assert sub.poll(5000), "the publisher never connected to the subscriber's address"
        topic, seq, payload = sub.recv_multipart()
        assert (topic, int.from_bytes(seq, "big")) == (b"kv", 0)
        assert msgpack.unpackb(payload)[1] == [{"type": "AllBlocksCleared"}]
    finally:
        publisher.close()
        ctx.destroy(linger=0)


@pytest.mark.slow
def test_a_fresh_publisher_announces_an_empty_cache_to_its_first_subscriber():
    """A router reconnecting to a replica restarted on the same port learns at once that its blocks are gone."""
    from engine.kv.events import AllBlocksCleared, BlockStored, KVEventPublisher

    port = free_port()
    publisher = KVEventPublisher(f"tcp://*:{port}", topic="kv", block_size=BLOCK)
    ctx = zmq.Context()
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        sub.connect(f"tcp://127.0.0.1:{port}")
        assert sub.poll(5000), "no announcement"
        topic, seq, payload = sub.recv_multipart()
        assert (topic, int.from_bytes(seq, "big")) == (b"kv", 0)
        assert msgpack.unpackb(payload)[1] == [{"type": "AllBlocksCleared"}]
        publisher.publish([BlockStored([bytes(16)], None, list(range(BLOCK)), "GPU")])
        # seq 1 has left the publisher's thread once the first subscriber holds it; only then may the late one join
        assert sub.poll(5000) and int.from_bytes(sub.recv_multipart()[1], "big") == 1
        late = ctx.socket(zmq.SUB)  # a second subscriber after the stream began gets no announcement
        late.setsockopt(zmq.SUBSCRIBE, b"kv")
        late.connect(f"tcp://127.0.0.1:{port}")
        time.sleep(0.3)
        publisher.publish([AllBlocksCleared()])
        assert late.poll(5000) and int.from_bytes(late.recv_multipart()[1], "big") == 2
    finally:
        ctx.destroy(linger=0)
        publisher.close()
