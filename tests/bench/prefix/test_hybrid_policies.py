"""The hybrid benchmark's claims (docs/HYBRID_CACHE.md, `kvserve bench prefix --hybrid`): the snapshot bytes of the
released Qwen3.6 shapes, and kvserve's snapshot policy reading at least what vLLM's align mode and llama.cpp's
checkpoints read on the agent workloads, at no more snapshot memory (small workloads; the documented table is the
full-size run)."""
from __future__ import annotations

import pytest

from benchmarks.prefix.policies.hybrid import HYBRID_SHAPES, MIB, StateCost, compare
from benchmarks.prefix.traces.render import load_model_text, tokenize_workload
from benchmarks.prefix.catalog import build_workloads
from benchmarks.prefix.workloads import WorkloadParams


@pytest.mark.parametrize("shape,kv_kib,state_mib,align_block", [("Qwen3.6-27B", 64, 146.8, 784),
                                                                 ("Qwen3.6-35B-A3B", 20, 61.4, 1056)])
def test_snapshot_bytes_of_the_released_shapes(shape: str, kv_kib: int, state_mib: float, align_block: int) -> None:
    cost = StateCost.of(HYBRID_SHAPES[shape])
    assert cost.kv_bytes_per_token == kv_kib * 1024
    assert round(cost.state_bytes / MIB, 1) == state_mib
    assert cost.vllm_align_block == align_block


def test_snapshot_bytes_of_kimi_linear() -> None:
    """Kimi-Linear-48B-A3B: 7 MLA layers keep a 576-value latent a token, 20 KDA layers a 3 x 4,096-channel conv
    window and a 32 x 128 x 128 fp32 state (what kvserve allocates for it, engine/models/kimi_linear.py)."""
    full = [4, 8, 12, 16, 20, 24, 27]
    cost = StateCost.of(dict(
        model_type="kimi_linear", vocab_size=163840, hidden_size=2304, intermediate_size=9216, num_hidden_layers=27,
        num_attention_heads=32, num_key_value_heads=32, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, num_experts=256, num_experts_per_token=8, moe_intermediate_size=1024,
        linear_attn_config=dict(full_attn_layers=full, kda_layers=[i for i in range(1, 28) if i not in full],
                                num_heads=32, head_dim=128, short_conv_kernel_size=4)))
    assert cost.kv_bytes_per_token == 7 * 576 * 2
    assert cost.state_bytes == 20 * (3 * 4096 * 3 * 2 + 32 * 128 * 128 * 4)
    assert cost.vllm_align_block == 1888


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
