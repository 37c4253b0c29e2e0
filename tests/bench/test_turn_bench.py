"""`kvserve bench turns` on a short conversation: every turn is served through the real pipeline (its ids equal a full
render + tokenize, or the bench raises), later turns hit the cache for all but their new tokens, and each figure the
table prints is measured (the host time inside the TTFT, the floors positive)."""
from __future__ import annotations

import argparse

import pytest

from benchmarks import turn_bench


@pytest.mark.slow  # loads qwen3-tiny into a serving context and serves three turns
def test_turns_grow_hit_the_cache_and_print_their_floor(tmp_path) -> None:
    args = argparse.Namespace(model="qwen3-tiny", start_tokens=600, max_tokens=1000, new_tokens=200, threads=1,
                              device="cpu", out_dir=str(tmp_path))
    figures = turn_bench.run(args)
    turns = figures["turns"]
    assert [t["turn"] for t in turns] == [1, 2, 3]
    assert turns[0]["cached_tokens"] == 0
    for before, turn in zip(turns, turns[1:]):
        assert turn["prompt_tokens"] > before["prompt_tokens"]
        # the last turn's prompt is cached but its partial last block; the new tool call and result are not
        assert before["prompt_tokens"] - 16 <= turn["cached_tokens"] <= before["prompt_tokens"]
        assert 150 <= turn["new_tokens"] <= 300
    for turn in turns:
        assert 0 < turn["host_s"] < turn["ttft_s"] and turn["attention_s"] > 0 and turn["dense_s"] > 0
    assert (tmp_path / "turns.md").read_text().count("\n") == 2 + len(turns)
