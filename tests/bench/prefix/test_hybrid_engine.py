"""The engine serving a hybrid model reads exactly what the hybrid simulator (benchmarks/prefix/policies/hybrid.py) predicts,
request for request, on agent workloads carrying the server's snapshot hints."""
from __future__ import annotations

import pytest

from benchmarks.prefix.policies.hybrid import HYBRID_SHAPES, StateCost
from benchmarks.prefix.policies.hybrid_engine import compare_with_engine
from benchmarks.prefix.traces.render import load_model_text, tokenize_workload
from benchmarks.prefix.catalog import build_workloads
from benchmarks.prefix.workloads import WorkloadParams


@pytest.mark.slow
@pytest.mark.slow
def test_engine_hits_equal_the_hybrid_simulator():
    from engine import LLM

    params = WorkloadParams(head_words=80, tasks=2, steps_per_task=1, result_words=(5, 20), reasoning_words=(3, 6),
                            forked_workers=1, fresh_workers=1, worker_steps=1)
    mt = load_model_text("qwen3.6-tiny")
    cost = StateCost.of(HYBRID_SHAPES["Qwen3.6-27B"])
    llm = LLM("qwen3.6-tiny", block_size=16, num_kv_blocks=1024, max_num_seqs=1, num_state_snapshots=16,
              max_num_batched_tokens=1024)
    try:
        for wl in build_workloads(["tool_loop", "subagents"], params):
            row = compare_with_engine(llm, wl.name, tokenize_workload(wl, mt), cost, slots=16)
            assert row["engine_cached"] == row["simulator_cached"]
            assert row["engine_hit_rate"] > 0.5
    finally:
        llm.close()
