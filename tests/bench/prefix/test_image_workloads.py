"""The screenshot-heavy Claude Code workload (claude_code_screenshots) on a vision-language model: its images become
the template's image tokens the server's way, the simulator hashes them as the engine does (the same screenshot
hits, a different one in the same place misses from its first block), and the engine reads what the simulator
predicts. Text-only models refuse the workload, and "all" leaves it out."""
from __future__ import annotations

from dataclasses import replace

import pytest

from benchmarks.prefix.catalog import IMAGE_WORKLOADS, build_workloads
from benchmarks.prefix.traces.render import load_model_text, tokenize_workload
from benchmarks.prefix.simulator import SimConfig, simulate
from benchmarks.prefix.workloads import WorkloadParams

SMALL = WorkloadParams(head_words=80, tasks=2, steps_per_task=2, result_words=(5, 20), reasoning_words=(3, 6))
BS = 16


@pytest.fixture(scope="module")
def vlm_requests():
    [workload] = build_workloads(["claude_code_screenshots"], SMALL)
    return tokenize_workload(workload, load_model_text("qwen3.6-tiny"))


@pytest.mark.slow
def test_the_same_screenshot_hits_and_another_in_its_place_misses_from_its_first_block(vlm_requests) -> None:
    first = {r.session: r for r in vlm_requests if r.turn == 0}
    a, b, c = first["shots0"], first["shots1"], first["shots2"]
    # All three paste a mockup at the same place, as the same run of image tokens (the processor's 60 for 320x192);
    # sessions 0 and 1 paste the same one, session 2 another.
    [shot_a], [shot_b], [shot_c] = a.images, b.images, c.images
    assert shot_a.offset == shot_b.offset == shot_c.offset and shot_a.num_tokens == 60
    assert a.prompt[: shot_a.end] == b.prompt[: shot_a.end] == c.prompt[: shot_a.end]
    assert shot_a.content_hash == shot_b.content_hash != shot_c.content_hash
    result = simulate(vlm_requests, SimConfig(block_size=BS, model_id="qwen3.6-tiny"))
    cached = {r.request_id: r.cached_tokens for r in result.results}
    assert cached[a.request_id] == 0
    assert cached[b.request_id] >= shot_a.end // BS * BS  # through the shared screenshot
    assert cached[c.request_id] == shot_c.offset // BS * BS  # up to the block holding its first image token
    # Hashing the placeholder tokens alone would serve session 0's mockup for session 2's.
    blind = simulate([replace(r, images=()) for r in vlm_requests], SimConfig(block_size=BS, model_id="qwen3.6-tiny"))
    assert {r.request_id: r.cached_tokens for r in blind.results}[c.request_id] >= shot_c.end // BS * BS
    # Later turns carry every earlier screenshot, some read twice (the same pixels at a later place).
    assert any(len({i.content_hash for i in r.images}) < len(r.images) for r in vlm_requests)
    assert 0.5 < result.hit_rate < 1
    print(f"claude_code_screenshots simulator hit rate {result.hit_rate:.1%} over {len(vlm_requests)} requests")


@pytest.mark.slow
def test_the_engine_reads_what_the_simulator_predicts(vlm_requests) -> None:
    from engine import LLM

    from benchmarks.prefix.policies.hybrid import HYBRID_SHAPES, StateCost
    from benchmarks.prefix.policies.hybrid_engine import compare_with_engine

    # qwen3.6-tiny is hybrid: the hybrid simulator (snapshots at the server's hints) is the one that predicts it.
    llm = LLM("qwen3.6-tiny", block_size=BS, num_kv_blocks=1024, max_num_seqs=1, num_state_snapshots=16,
              max_num_batched_tokens=1024)
    try:
        row = compare_with_engine(llm, "claude_code_screenshots", vlm_requests,
                                  StateCost.of(HYBRID_SHAPES["Qwen3.6-27B"]), slots=16)
    finally:
        llm.close()
    assert row["engine_cached"] == row["simulator_cached"]  # request for request, image spans included
    assert row["engine_hit_rate"] > 0.5
    print(f"engine {row['engine_hit_rate']:.1%} vs simulator {row['simulator_hit_rate']:.1%}, "
          f"{row['requests_equal']}/{row['requests']} requests equal")


@pytest.mark.slow
def test_a_text_only_model_refuses_the_image_workload_and_all_leaves_it_out(capsys) -> None:
    from server.cli import main

    assert "claude_code_screenshots" in IMAGE_WORKLOADS
    assert main(["bench", "prefix", "--model", "qwen3-tiny", "--workload", "claude_code_screenshots",
                 "--no-engine"]) == 2
    err = capsys.readouterr().err
    assert "qwen3-tiny reads text only" in err and "--model qwen3.6-tiny" in err and "Traceback" not in err
