"""What the KV tiers and events keep of every tenant, and what they do with damage: a disk block damaged while the
server runs is a miss for its request alone; start-up skips what it cannot use without blocking; the disk tier's
size holds after a restart with a smaller one; its files are private; KV events stay on 127.0.0.1 unless told
otherwise and can leave token ids out."""
from __future__ import annotations

import os
import socket
import stat
import threading
import time
from pathlib import Path

import msgpack
import pytest
import zmq

from engine import LLM, SamplingParams
from engine.worker.kv_disk import DiskStore
from engine.kv.events import BlockStored, KVEventPublisher
from tests.hf_oracle import random_prompts

BLOCK = 16
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _disk_llm(tmp_path: Path, disk_gb: float = 0.01) -> LLM:
    return LLM("qwen3-tiny", block_size=BLOCK, num_kv_blocks=96, kv_offload_gb=0.01, kv_disk_dir=str(tmp_path),
               kv_disk_gb=disk_gb)


def _block_files(llm: LLM) -> list[Path]:
    return sorted(llm.engine.runner.kv_offload.disk.dir.glob("*/*.kvb"))


@pytest.mark.slow
def test_a_disk_block_damaged_while_running_is_a_miss_for_its_request_alone(tmp_path):
    """Flipping a byte of a block file, then sending the prompt that owns it, gave its request a 500 and failed the
    engine step for every request in flight."""
    a, other = random_prompts(151_000, [320, 200], seed=5)
    llm = _disk_llm(tmp_path)
    cold = llm.generate([a], GREEDY)[0]
    llm.close()  # every block of `a` is written through to disk
    llm = _disk_llm(tmp_path)  # a restart: the blocks are on disk only
    try:
        damaged = llm.engine.scheduler.hasher.hashes(a, None)[4]
        path = llm.engine.runner.kv_offload.disk.path(damaged)
        path.write_bytes(path.read_bytes()[:-1] + bytes([path.read_bytes()[-1] ^ 0xFF]))
        warm, bystander = llm.generate([a, other], GREEDY)
        assert warm.num_cached_tokens == 4 * BLOCK  # blocks 0-3 from disk, the damaged one and after recomputed
        assert warm.token_ids == cold.token_ids and len(bystander.token_ids) == GREEDY.max_tokens
        llm.engine.runner.kv_offload.flush()
        assert not path.exists()  # dropped: the next restart will not trip over it
        again = llm.generate([a], GREEDY)[0]
        assert again.token_ids == cold.token_ids and again.num_cached_tokens == (len(a) - 1) // BLOCK * BLOCK
    finally:
        llm.close()


def test_start_up_skips_what_it_cannot_use_without_blocking(tmp_path, monkeypatch):
    """A directory named `x.kvb` and an undeletable corrupt file stopped the server from starting; a FIFO named
    `x.kvb` hung its start-up forever."""
    layout = {"model": "m", "block_size": BLOCK}
    store = DiskStore(tmp_path, layout)
    good = bytes(range(16))
    store.write(good, None, (1, 2, 3), b"payload")
    sub = store.path(good).parent
    (sub / "dir.kvb").mkdir()
    fifo = sub / "fifo.kvb"
    os.mkfifo(fifo)
    stuck = sub / ("ab" * 16 + ".kvb")
    stuck.write_bytes(b"\x05\x00\x00\x00{bad}")  # corrupt, and (below) it cannot be deleted
    real_unlink = Path.unlink

    def unlink(self: Path, missing_ok: bool = False) -> None:
        if self == stuck:
            raise PermissionError(13, "Permission denied", str(self))
        real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", unlink)
    found: list = []
    scan = threading.Thread(target=lambda: found.append(DiskStore(tmp_path, layout).scan()), daemon=True)
    scan.start()
    scan.join(30)
    try:
        assert not scan.is_alive(), "start-up blocked on a FIFO in the disk tier"
    finally:
        if scan.is_alive():  # let the blocked open() return
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert [b.block_hash for b in found[0]] == [good]
    assert stuck.exists() and (sub / "dir.kvb").is_dir() and fifo.exists()  # left alone, logged


@pytest.mark.slow
def test_the_disk_tier_keeps_its_size_after_a_restart_with_a_smaller_one(tmp_path):
    """2,616 files were kept for 131 slots after a restart with a smaller --kv-disk-gb, and never deleted."""
    (a,) = random_prompts(151_000, [640], seed=6)
    llm = _disk_llm(tmp_path)
    llm.generate([a], GREEDY)
    llm.close()
    before = len(_block_files(llm))
    small = _disk_llm(tmp_path, disk_gb=0.0001)
    try:
        capacity = small.engine.scheduler.kv.tiers.disk.capacity
        small.engine.runner.kv_offload.flush()
        assert capacity < before and len(_block_files(small)) == capacity, (before, capacity)
        newest = small.engine.scheduler.hasher.hashes(a, None)[-capacity:]  # the chain's end was written last
        assert set(small.engine.scheduler.kv.tiers.disk.blocks) <= set(small.engine.scheduler.hasher.hashes(a, None))
        assert len(set(newest) & set(small.engine.scheduler.kv.tiers.disk.blocks)) > 0
    finally:
        small.close()


def test_disk_tier_files_are_private(tmp_path):
    store = DiskStore(tmp_path / "kv", {"model": "m"})
    store.write(bytes(16), None, (7, 8), b"tokens of a tenant")
    path = store.path(bytes(16))
    for p, mode in ((path, 0o600), (store.dir / "layout.json", 0o600), (path.parent, 0o700), (store.dir, 0o700)):
        assert stat.S_IMODE(p.stat().st_mode) == mode, (p, oct(p.stat().st_mode))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_kv_events_bind_127_0_0_1_unless_told_otherwise():
    port, replay_port = _free_port(), _free_port()
    local = KVEventPublisher(f"tcp://*:{port}", f"tcp://*:{replay_port}")
    try:
        assert local._pub.getsockopt(zmq.LAST_ENDPOINT) == f"tcp://127.0.0.1:{port}".encode()
        assert local._replay.getsockopt(zmq.LAST_ENDPOINT) == f"tcp://127.0.0.1:{replay_port}".encode()
    finally:
        local.close()
    port = _free_port()
    everywhere = KVEventPublisher(f"tcp://*:{port}", all_interfaces=True)
    try:
        assert everywhere._pub.getsockopt(zmq.LAST_ENDPOINT) == f"tcp://0.0.0.0:{port}".encode()
    finally:
        everywhere.close()


def test_kv_events_can_publish_hashes_without_token_ids():
    port = _free_port()
    publisher = KVEventPublisher(f"tcp://*:{port}", token_ids=False)
    sub = zmq.Context.instance().socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{port}")
        sub.poll(5000)  # the empty-cache announcement to a first subscriber
        sub.recv_multipart()
        deadline = time.monotonic() + 10
        while not sub.poll(100):
            assert time.monotonic() < deadline
            publisher.publish([BlockStored([bytes(16)], None, [5, 6, 7, 8], "GPU")])
        _, _, payload = sub.recv_multipart()
        [event] = msgpack.unpackb(payload)[1]
        assert event["type"] == "BlockStored" and event["token_ids"] == [] and event["block_hashes"] == [0]
    finally:
        sub.close(0)
        publisher.close()
