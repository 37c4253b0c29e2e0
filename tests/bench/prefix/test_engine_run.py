"""Engine-backed prefix runs: warm TTFT with identical outputs, and engine hits equal to the simulator's."""
from __future__ import annotations

import pytest

from benchmarks.prefix.engine_run import EngineSettings, make_llm, run_workload, ttft_cold_vs_warm
from benchmarks.prefix.traces.render import load_model_text, tokenize_workload
from benchmarks.prefix.simulator import SimConfig, simulate
from benchmarks.prefix.catalog import build_workloads
from benchmarks.prefix.workloads import WorkloadParams

SETTINGS = EngineSettings(num_kv_blocks=512, max_num_batched_tokens=1024, max_num_seqs=4, max_tokens=2)


@pytest.fixture(scope="module")
def llm():
    return make_llm(SETTINGS)


def test_ttft_warm_is_faster_and_outputs_identical(llm):
    probe = [(i * 7919) % 150000 for i in range(1, 1025)]
    result = ttft_cold_vs_warm(llm, probe, cached_fraction=0.9, max_tokens=4)
    assert result.cached_tokens == int(1024 * 0.9) // 16 * 16
    assert result.outputs_identical
    assert result.warm_ttft_s < result.cold_ttft_s
    print(f"cold {result.cold_ttft_s:.3f}s warm {result.warm_ttft_s:.3f}s speedup {result.speedup:.1f}x")


@pytest.mark.slow
def test_engine_hits_match_the_simulator(llm):
    params = WorkloadParams(head_words=80, tasks=2, steps_per_task=1, result_words=(5, 20), reasoning_words=(3, 6),
                            sessions=2, session_steps=1)
    mt = load_model_text(SETTINGS.model)
    for wl in build_workloads(["tool_loop", "tenants_salted"], params):
        reqs = tokenize_workload(wl, mt)
        run = run_workload(llm, wl.name, reqs, SETTINGS)
        sim = simulate(reqs, SimConfig(block_size=SETTINGS.block_size, max_num_seqs=SETTINGS.max_num_seqs,
                                       commit_outputs=False, model_id=SETTINGS.model))
        assert [r.cached_tokens for r in run.results] == [sim.by_id[r.request_id].cached_tokens for r in run.results]
        assert run.cached_tokens > 0
