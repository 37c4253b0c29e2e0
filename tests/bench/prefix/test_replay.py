"""Reading `kvserve serve --record` traces: parent inference, change detection, simulated vs recorded hits."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.prefix.traces.replay import read_records, records_to_requests
from benchmarks.prefix.simulator import SimConfig, simulate
from server.cache.miss_causes import CHANGE_SYSTEM, CHANGE_TOOLS
from server.cli import main as kvserve

MSG0 = [{"role": "user", "content": "hi"}]
MSG1 = MSG0 + [{"role": "assistant", "content": "yo"}, {"role": "user", "content": "more"}]
ROWS = [
    {"body": {"messages": MSG0}, "prompt_token_ids": list(range(1, 21)), "output_token_ids": [21, 22],
     "cached_tokens": 0, "timings": {"ttft_s": 0.5}},
    {"body": {"messages": MSG1}, "prompt_token_ids": [*range(1, 23), *range(30, 36)], "output_token_ids": [7],
     "cached_tokens": 20, "timings": {}},
    {"body": {"messages": MSG0, "tools": [{"type": "function", "function": {"name": "f"}}]},
     "prompt_token_ids": [*range(1, 9), *range(50, 61)], "output_token_ids": [], "cached_tokens": 8},
]
SALTED = {"body": {"messages": MSG0, "cache_salt": "body-salt"}, "prompt_token_ids": list(range(1, 21)),
          "cached_tokens": 0, "cache_salt": "tenant-hash"}


@pytest.fixture
def record_file(tmp_path: Path) -> Path:
    path = tmp_path / "rec.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def test_parents_and_changes(record_file: Path):
    reqs = records_to_requests(read_records(record_file), block_size=4)
    assert [r.parent for r in reqs] == [None, "r0", "r0"]
    assert [r.change for r in reqs] == [None, None, CHANGE_TOOLS]
    assert reqs[1].session == reqs[0].session and reqs[1].turn == 1


def test_a_changed_system_prompt_is_named(tmp_path: Path):
    """Chat's system message and Anthropic's top-level system prompt: an edit there is a system-prompt change."""
    system = [{"role": "system", "content": "rules v1"}, *MSG0]
    edited = [{"role": "system", "content": "rules v2"}, *MSG0]
    anthropic = {"system": "rules v1", "messages": MSG0}
    rows = [{"body": {"messages": system}}, {"body": {"messages": edited}}, {"body": anthropic},
            {"body": {**anthropic, "system": "rules v2"}}]
    path = tmp_path / "system.jsonl"
    heads = [[1, 2, 3, 4], [1, 2, 3, 4], [9, 8, 7, 6], [9, 8, 7, 6]]  # two conversations of two turns
    path.write_text("".join(json.dumps({**r, "prompt_token_ids": [*head, i], "cached_tokens": 0}) + "\n"
                            for i, (r, head) in enumerate(zip(rows, heads))))
    reqs = records_to_requests(read_records(path), block_size=4)
    assert [r.parent for r in reqs] == [None, "r0", None, "r2"]
    assert [r.change for r in reqs] == [None, CHANGE_SYSTEM, None, CHANGE_SYSTEM]


def test_effective_salt_wins_over_the_body(tmp_path: Path):
    path = tmp_path / "salted.jsonl"
    path.write_text(json.dumps(SALTED) + "\n" + json.dumps({**SALTED, "cache_salt": None}) + "\n")
    assert [r.cache_salt for r in read_records(path)] == ["tenant-hash", "body-salt"]


def test_simulated_hits_by_hand(record_file: Path):
    # r1: r0's prompt + reply = 22 ids -> 5 full blocks; r2 shares 8 tokens -> 2 blocks.
    result = simulate(records_to_requests(read_records(record_file), 4), SimConfig(block_size=4, max_num_seqs=1))
    assert [r.cached_tokens for r in result.results] == [0, 20, 8]
    assert result.hit_rate == pytest.approx(28 / 67)


def test_cli_replay(record_file: Path, tmp_path: Path):
    out = tmp_path / "replay.json"
    assert kvserve(["bench", "replay", "--trace", str(record_file), "--block-size", "4", "--json", str(out),
                    "--out-dir", str(tmp_path / "o")]) == 0
    fig = json.loads(out.read_text())
    assert fig["hit_rate"] == pytest.approx(28 / 67)
    assert fig["recorded_hit_rate"] == pytest.approx(28 / 67)
    # r0: 20 cold. r1: 2 ids of r0's context are a partial block, 6 new. r2: after the 8 shared tokens, the rest of
    # its 19 tokens (all within the length of r0's context) is lost to the changed tool list.
    assert fig["miss_causes"] == {"first_request": 20, "tool_list": 11, "new_tokens": 6, "block_granularity": 2}


def test_bad_record_line(tmp_path: Path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"body": {}}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        read_records(bad)
