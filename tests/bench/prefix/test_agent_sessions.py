"""Concurrent agent sessions with tool-call gaps: the workload's shape, the simulator's time model (think times,
holds that expire), and the engine replaying a simulated schedule with the same cached tokens for every request, in
all four variants (device-only LRU, session retention, host tier, both) under memory pressure."""
from __future__ import annotations

from dataclasses import replace

import pytest

from benchmarks.prefix.agent_sessions import SessionsParams, agent_sessions
from benchmarks.prefix.engine_run import EngineSettings, VirtualClock, make_llm, replay_schedule
from benchmarks.prefix.sessions_bench import VARIANTS, Variant, bytes_per_block, variant_config
from benchmarks.prefix.simulator import CostModel, SimConfig, simulate
from benchmarks.prefix.traces.trace import TokenRequest
from engine.outputs import SchedulerStats

SMALL = SessionsParams(sessions=6, turns=4, shared_tokens=320, task_tokens=80, result_tokens=(40, 160),
                       reply_tokens=(10, 30), tool_gap_median_s=6.0, start_window_s=20.0, seed=5)
COSTS = CostModel(prefill_tokens_per_s=20_000, decode_step_s=0.005, bytes_per_block=8192)


def test_sessions_workload_shape():
    requests = agent_sessions(SMALL)
    assert len(requests) == SMALL.sessions * SMALL.turns
    by_id = {r.request_id: r for r in requests}
    for r in requests:
        if r.parent is None:
            assert r.prompt[: SMALL.shared_tokens] == requests[0].prompt[: SMALL.shared_tokens] and r.think_s == 0
        else:
            parent = by_id[r.parent]
            assert r.prompt[: len(parent.prompt) + len(parent.output)] == parent.prompt + parent.output
            assert r.think_s > 0
    assert {r.ends_in_tool_call for r in requests} == {True, False}
    assert not any(r.ends_in_tool_call for r in requests if r.turn == SMALL.turns - 1)


def test_think_time_delays_the_next_turn_and_holds_expire():
    prompt = list(range(100, 140))
    a0 = TokenRequest("a0", "a", prompt, output=[7] * 4, ends_in_tool_call=True)
    a1 = TokenRequest("a1", "a", prompt + [7] * 4 + [9] * 8, parent="a0", turn=1, think_s=50.0)
    others = [TokenRequest(f"b{i}", f"b{i}", list(range(1000 * (i + 1), 1000 * (i + 1) + 40)), arrival=30 + i)
              for i in range(3)]
    cfg = SimConfig(block_size=4, max_num_seqs=1, num_kv_blocks=24, costs=COSTS)
    for ttl, cached in ((0.0, 0), (60.0, 44), (20.0, 0)):  # no hold; a hold that outlasts the gap; one that expires
        result = simulate([a0, *others, a1], replace(cfg, tool_call_ttl_s=ttl))
        assert result.by_id["a1"].start >= 50.0
        assert result.by_id["a1"].cached_tokens == cached, ttl


def test_host_tier_recovers_what_the_device_pool_lost():
    requests = agent_sessions(SMALL)
    base = SimConfig(block_size=16, max_num_seqs=4, num_kv_blocks=90, engine_max_tokens=4, commit_outputs=False,
                     costs=COSTS)
    lru, host = (simulate(requests, variant_config(base, v, 30.0, 400)) for v in (VARIANTS[0], VARIANTS[2]))
    assert host.hit_rate > lru.hit_rate
    assert host.ttft_p50_s < lru.ttft_p50_s
    assert sum(r.restored_blocks[0] for r in host.results) > 0


def _replay(variant: Variant, model: str = "qwen3-tiny", **engine) -> tuple[list[tuple[int, int]], SchedulerStats]:
    """SMALL replayed through ``model``'s engine on the simulator's schedule under pressure: per request (simulated
    cached tokens, the engine's), and the engine's stats."""
    requests = agent_sessions(SMALL)
    clock = VirtualClock()
    settings = EngineSettings(model=model, num_kv_blocks=90, max_num_seqs=4, max_num_batched_tokens=8192,
                              max_tokens=4, kv_offload_gb=400.5 * 8192 / 2**30 if variant.host else 0.0, **engine)
    llm = make_llm(settings, clock=clock)
    try:
        assert bytes_per_block(llm) == COSTS.bytes_per_block
        base = SimConfig(block_size=16, max_num_seqs=4, num_kv_blocks=90, engine_max_tokens=4, commit_outputs=False,
                         costs=COSTS, model_id=model)
        sim = simulate(requests, variant_config(base, variant, 30.0, llm.stats.kv_host_blocks_total))
        run = replay_schedule(llm, clock, requests, sim, max_tokens=4)
        engine_cached = {r.request_id: r.cached_tokens for r in run.results}
        return [(r.cached_tokens, engine_cached[r.request_id]) for r in sim.results], llm.stats
    finally:
        llm.close()


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
@pytest.mark.slow
def test_engine_replay_matches_the_simulator_request_for_request(variant):
    cached, stats = _replay(variant)
    assert all(sim == engine for sim, engine in cached), cached
    assert stats.preemptions == 0 and stats.prefix_cache_evictions > 0  # under pressure, without preemption
    assert (stats.prefix_cache_host_hits_tokens > 0) == variant.host


@pytest.mark.slow
@pytest.mark.slow
def test_hybrid_engine_replay_reads_within_a_block_of_the_dense_simulator():
    """qwen3.6-tiny resumes only at recurrent-state snapshots (the shared head, where the server hints one; prompt
    ends; reply ends): under pressure, with a host tier and session holds, each request reads at most one block less
    than the dense simulator's cache (`kvserve bench sessions --model qwen3.6-tiny`)."""
    cached, _ = _replay(VARIANTS[-1], "qwen3.6-tiny", num_state_snapshots=16)  # + both
    assert all(0 <= sim - engine <= 16 for sim, engine in cached), cached
    assert sum(engine for _, engine in cached) > 0.5 * sum(sim for sim, _ in cached)



@pytest.mark.slow
def test_sessions_bench_runs_a_window_model_beside_a_dense_one_in_the_same_memory(tmp_path):
    """`kvserve bench sessions --no-scale --model gemma3-tiny` (16-token window; here 4 sessions x 3 turns of SMALL in
    a 72-block pool, device-only LRU): the dense run (every layer full) reads what the simulator predicts request
    for request, under pressure; the window group, in the same device KV bytes on the same schedule, keeps >= 80%
    of its cached tokens, and the table says so."""
    from pathlib import Path

    from benchmarks.prefix.sessions_bench import SessionsOptions, run_sessions

    figures = run_sessions(SessionsOptions(scale=False, model="gemma3-tiny", engine_blocks=72,
                                           engine_params=replace(SMALL, sessions=4, turns=3),
                                           variants=VARIANTS[:1], engine_costs=COSTS, out_dir=str(tmp_path)))
    [row] = figures["engine"]["variants"]
    assert row["requests_matching"] == row["requests"] and row["engine_evictions"] > 0, row
    assert 0.95 * row["engine_kv_bytes"] <= row["window_kv_bytes"] <= row["engine_kv_bytes"], row
    assert row["window_cached_tokens"] >= 0.8 * row["engine_cached_tokens"], row
    assert "window cached tokens" in Path(figures["markdown"]).read_text()
