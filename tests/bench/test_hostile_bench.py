"""`kvserve bench hostile` end to end on two of its inputs (the full run is docs/bench/HOSTILE.md)."""
from __future__ import annotations

import pytest

from benchmarks.hostile import HostileOptions, markdown, run_hostile_bench


@pytest.mark.slow
@pytest.mark.slow
def test_hostile_bench_reports_each_input_against_the_baselines(tmp_path):
    figures = run_hostile_bench(HostileOptions(only=["seed", "surrogate"], quiet_s=1.0, log_dir=tmp_path))
    assert [r["input"] for r in figures["inputs"]] == ["seed 2^64", "lone surrogate"]
    assert all(r["status"] == 400 and r["healthy"] and not r["errors"] for r in figures["inputs"])
    assert len(figures["baseline_worst_wait_s"]) == 2 and figures["bystander_errors"] == 0
    assert "| seed 2^64 | 400 |" in markdown(figures)
