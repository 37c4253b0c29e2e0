"""`kvserve bench step` end to end on small shapes: engine and bare steps measured in turn, with and without overlap,
the engine as the offline API runs it (its outputs handed off and turned into text every step)."""
from __future__ import annotations

import pytest

from benchmarks.step_bench import markdown, run_step_bench


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.fast_cases("True")
def test_step_bench_measures_every_point(async_scheduling: bool) -> None:
    points = run_step_bench("cpu", [1, 3], [32, 64], steps=3, warmup=1, async_scheduling=async_scheduling, flush_mb=1)
    assert [(p.batch, p.context) for p in points] == [(1, 32), (3, 32), (1, 64), (3, 64)]
    for p in points:
        assert 0 < p.host_ms < p.engine_ms and p.device_ms > 0 and p.bare_ms > 0
        assert async_scheduling or p.device_ms <= p.engine_ms  # overlapped, a step's compute may end in the next
        assert p.engine_cpu_ms is not None and p.bare_cpu_ms is not None and p.host_cpu_ms is not None
        # each step's outputs reached the offline API's sink, inside the step's time
        assert 0 < p.text_ms < p.engine_ms and 0 < p.step_ms < p.engine_ms and p.text_cpu_ms is not None
    table = markdown(points)
    assert table.count("\n| 3 | 64 |") == 2  # the wall-time table and the CPU-time table
