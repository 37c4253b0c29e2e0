"""Mooncake reader and block-hash simulation: a hand-computed synthetic trace, and the real traces of
../shared/data/mooncake, whose unbounded hit rates the simulator must reproduce as the data's README defines and
publishes them (computed here from the traces; the README's figures read from it)."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from benchmarks.prefix.traces.mooncake import MOONCAKE_BLOCK_TOKENS, MooncakeRecord, mooncake_requests, read_mooncake
from benchmarks.prefix.simulator import SimConfig, simulate
from server.cli import main as kvserve

ROWS = [
    {"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1]},
    {"timestamp": 10, "input_length": 1500, "output_length": 5, "hash_ids": [0, 1, 2]},
    {"timestamp": 20, "input_length": 700, "output_length": 5, "hash_ids": [0, 1]},
    {"timestamp": 30, "input_length": 600, "output_length": 5, "hash_ids": [5, 1]},
]
TOTAL = 1000 + 1500 + 700 + 600


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def sim(path: Path, capacity: int | None) -> float:
    return sim_records(read_mooncake(path), capacity)


def sim_records(records: list[MooncakeRecord], capacity: int | None) -> float:
    return simulate(mooncake_requests(records), SimConfig(block_size=1, max_num_seqs=1,
                                                          capacity_blocks=capacity)).hit_rate


def test_reader(trace: Path):
    records = read_mooncake(trace)
    assert [r.hash_ids for r in records] == [(0, 1), (0, 1, 2), (0, 1), (5, 1)]
    assert records[1].input_length == 1500 and records[2].timestamp == 20.0
    assert len(read_mooncake(trace, limit=2)) == 2


def test_reader_rejects_bad_lines(tmp_path: Path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 5}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        read_mooncake(bad)


def test_unbounded_hit_rate_by_hand(trace: Path):
    # r1 matches blocks 0,1 -> 1024 tokens; r2 matches all of its blocks -> min(1024, 700) (the last block counts:
    # the sentinel is what gets recomputed); r3 starts with another block -> 0.
    assert sim(trace, None) == pytest.approx((1024 + 700) / TOTAL)


def test_capacity_by_hand(trace: Path):
    assert sim(trace, 2) == pytest.approx((1024 + 700) / TOTAL)  # LRU evicts leaf 2, keeps 0 -> 1
    # One block: only block 0 survives between requests, so r1 and r2 get 512 each.
    assert sim(trace, 1) == pytest.approx((512 + 512) / TOTAL)
    assert sim(trace, 0) == 0.0


def test_sentinel_never_takes_capacity(trace: Path):
    result = simulate(mooncake_requests(read_mooncake(trace)), SimConfig(block_size=1, max_num_seqs=1))
    # Distinct prefix blocks: 0, 0-1, 0-1-2, 5, 5-1. A cached sentinel would add one per request.
    assert result.peak_cached_blocks == 5


def test_cli_simulate_writes_json(trace: Path, tmp_path: Path):
    out = tmp_path / "fig.json"
    rc = kvserve(["bench", "simulate", "--trace", str(trace), "--capacity-blocks", "1", "--sweep", "1,2",
                  "--json", str(out), "--out-dir", str(tmp_path / "o")])
    assert rc == 0
    fig = json.loads(out.read_text())
    assert fig["hit_rate"] == pytest.approx(1024 / TOTAL)
    assert fig["ideal_hit_rate"] == pytest.approx(1724 / TOTAL)
    assert [p["capacity_blocks"] for p in fig["capacity_curve"]] == [1, 2]
    assert Path(fig["plot"]).exists()


SHARED = Path(__file__).resolve().parents[3].parent / "shared" / "data" / "mooncake"
# "... is 37.4% for the conversation trace and 65.1% for the synthetic trace." (the data's README)
PUBLISHED = re.compile(r"is ([0-9.]+)% for the conversation trace and ([0-9.]+)% for the synthetic trace")


def shared_file(name: str) -> Path:
    """A file of ../shared/data/mooncake. Outside CI a checkout without ../shared skips, saying so; in CI (`.ci/run`
    sets KVSERVE_CI, and its checkout has ../shared beside the repository) its absence is a failure."""
    path = SHARED / name
    if not path.exists():
        missing = f"{path} not present (the CI checkout has ../shared beside the repository)"
        if os.environ.get("KVSERVE_CI"):
            pytest.fail(missing)
        pytest.skip(missing)
    return path


def hit_rate_as_published(records: list[MooncakeRecord]) -> float:
    """The data README's definition, independent of the simulator: in file order with an unbounded cache, a request
    matches its longest chain of hash ids seen before (as a prefix of an earlier request's), and hits
    min(matched_blocks * 512, input_length) of its input tokens."""
    seen: set[tuple[int, ...]] = set()
    hits = total = 0
    for record in records:
        matched = 0
        while matched < len(record.hash_ids) and record.hash_ids[: matched + 1] in seen:
            matched += 1
        hits += min(matched * MOONCAKE_BLOCK_TOKENS, record.input_length)
        total += record.input_length
        seen.update(record.hash_ids[:k] for k in range(1, len(record.hash_ids) + 1))
    return hits / total


def test_the_published_definition_by_hand(trace: Path):
    """The oracle below agrees with the hand-computed figure of the synthetic trace above."""
    assert hit_rate_as_published(read_mooncake(trace)) == pytest.approx((1024 + 700) / TOTAL)


@pytest.mark.parametrize("index, name", [(0, "conversation"), (1, "synthetic")])
def test_published_unbounded_hit_rates(index: int, name: str):
    """The simulator's unbounded hit rate on the real traces equals the README's definition computed here, and both
    round to the figure the README publishes (read from it, not copied into this test)."""
    records = read_mooncake(shared_file(f"{name}_trace.jsonl"))
    match = PUBLISHED.search(shared_file("README.md").read_text())
    assert match, "the data's README no longer states the published hit rates in the sentence this test reads"
    published = float(match.group(index + 1)) / 100
    expected = hit_rate_as_published(records)
    assert sim_records(records, None) == pytest.approx(expected, abs=1e-12)
    assert round(expected, 3) == pytest.approx(published)
