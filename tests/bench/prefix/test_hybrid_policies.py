"""The hybrid benchmark's claims (docs/HYBRID_CACHE.md, `kvserve bench prefix --hybrid`): the snapshot bytes of the
released Qwen3.6 shapes, and kvserve's snapshot policy reading at least what vLLM's align mode and llama.cpp's
checkpoints read on the agent workloads, at no more snapshot memory (small workloads; the documented table is the
full-size run)."""
from __future__ import annotations

import pytest

from benchmarks.prefix.policies.hybrid import HYBRID_SHAPES, MIB, StateCost, compare
from benchmarks.prefix.render import load_model_text, tokenize_workload
from benchmarks.prefix.catalog import build_workloads
from benchmarks.prefix.workloads import WorkloadParams


@pytest.mark.parametrize("shape,kv_kib,state_mib,align_block", [("Qwen3.6-27B", 64, 146.8, 784),
                                                                 ("Qwen3.6-35B-A3B", 20, 61.4, 1056)])
def test_snapshot_bytes_of_the_released_shapes(shape: str, kv_kib: int, state_mib: float, align_block: int) -> None:
    cost = StateCost.of(HYBRID_SHAPES[shape])
    assert cost.kv_bytes_per_token == kv_kib * 1024
    assert round(cost.state_bytes / MIB, 1) == state_mib
    assert cost.vllm_align_block == align_block


@pytest.mark.slow  # renders and simulates two workloads: about 30 s
@pytest.mark.slow
def test_kvserve_reads_at_least_the_best_of_them_at_no_more_memory() -> None:
    params = WorkloadParams(head_words=300, tasks=2, steps_per_task=2, result_words=(20, 120), forked_workers=2,
                            fresh_workers=2, worker_steps=2)
    mt = load_model_text("qwen3.6-tiny")
    cost = StateCost.of(HYBRID_SHAPES["Qwen3.6-27B"])
    for workload in build_workloads(["claude_code", "subagents"], params):
        runs = compare(tokenize_workload(workload, mt), cost, [2, 4, 16])
        kvserve = {r.slots: r for r in runs if r.policy == "kvserve"}
        for other in runs:
            if other.policy.startswith(("vLLM", "llama.cpp")):
                # the same pool size (vLLM), or as many snapshots as llama.cpp's slots kept at their peak
                slots = other.slots or max((n for n in kvserve if n <= other.peak_snapshots), default=None)
                if slots is not None:
                    assert kvserve[slots].hit_rate >= other.hit_rate, (workload.name, other.policy, slots,
                                                                      kvserve[slots].hit_rate, other.hit_rate)
        assert kvserve[16].hit_rate > 0.5, workload.name
