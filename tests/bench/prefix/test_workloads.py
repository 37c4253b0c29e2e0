"""Workload generators: determinism, structure, and what rendering through the real Qwen3 template does to them."""
from __future__ import annotations

from dataclasses import replace

import pytest

from benchmarks.prefix.traces.render import load_model_text, request_change, tokenize_workload
from benchmarks.prefix.simulator import SimConfig, simulate
from benchmarks.prefix.catalog import IMAGE_WORKLOADS, WORKLOADS, build_workloads
from benchmarks.prefix.workloads import WorkloadParams
from server.cache.miss_causes import CHANGE_HISTORY, CHANGE_REASONING, CHANGE_TOOLS, template_change

SMALL = WorkloadParams(
    head_words=120, tasks=2, steps_per_task=2, result_words=(5, 30), reasoning_words=(5, 10), compaction_words=150,
    forked_workers=1, fresh_workers=1, worker_steps=1, sessions=2, session_steps=1, groups=2, questions=2,
    shared_prefix_words=60, question_words=8, num_prefixes=2, repetitions=2, repeated_prefix_words=50,
)


def as_data(workloads):
    return [[(r.request_id, r.parent, r.salt, r.messages, r.tools, r.reply) for r in w.requests] for w in workloads]


def test_deterministic_from_seed():
    assert as_data(build_workloads("all", SMALL)) == as_data(build_workloads("all", SMALL))
    assert as_data(build_workloads("tool_loop", SMALL)) != as_data(build_workloads("tool_loop", replace(SMALL, seed=1)))


def test_unknown_workload_is_an_error():
    with pytest.raises(ValueError, match="unknown workload"):
        build_workloads(["nope"], SMALL)


def _changes(name: str) -> list[str | None]:
    (wl,) = build_workloads(name, SMALL)
    by_id = {r.request_id: r for r in wl.requests}
    return [request_change(by_id.get(r.parent), r) for r in wl.requests]


def test_message_level_structure():
    assert set(_changes("tool_loop")) == {None}
    assert _changes("tool_change").count(CHANGE_TOOLS) == 1
    assert set(_changes("tool_append")) == {None}  # the new tool goes to the tail: the messages only grow
    assert set(_changes("projects")) == {None}  # every session's turns only grow
    assert CHANGE_HISTORY in _changes("compaction")
    (sub,) = build_workloads("subagents", SMALL)
    sessions = {r.session for r in sub.requests}
    assert any(s.startswith("fork") for s in sessions) and any(s.startswith("fresh") for s in sessions)
    order = {r.request_id: i for i, r in enumerate(sub.requests)}
    assert all(order[r.parent] < order[r.request_id] for r in sub.requests if r.parent)
    (salted,) = build_workloads("tenants_salted", SMALL)
    assert len({r.salt for r in salted.requests}) == SMALL.sessions


def test_template_change_detection():
    assert template_change("abc", "abcdef") is None
    assert template_change("x<think>\nr\n</think>\n\n<tool_call>", "x<tool_call>") == CHANGE_REASONING
    assert template_change("abcd", "abXd") == "template"


@pytest.fixture(scope="module")
def qwen3():
    return load_model_text("qwen3-tiny")


@pytest.mark.slow
def test_qwen3_tool_loop_tokens(qwen3):
    (wl,) = build_workloads("tool_loop", SMALL)
    reqs = tokenize_workload(wl, qwen3)
    by_id = {r.request_id: r for r in reqs}
    for r in reqs[1:]:
        parent = by_id[r.parent]
        context = parent.prompt + parent.output
        if r.change is None:  # a tool step inside a task: the new prompt extends the old context token for token
            assert r.prompt[: len(context)] == context
        else:  # a new user task: Qwen3 drops the reasoning of the previous task's turns
            assert r.change == CHANGE_REASONING and r.prompt[: len(context)] != context
    assert [r.change for r in reqs].count(CHANGE_REASONING) == SMALL.tasks - 1


def test_ideal_hit_rate_of_the_tool_loop_by_hand(qwen3):
    # Unbounded cache, one request at a time: request i reuses the full blocks of its parent's context up to the
    # first differing token, capped at (len(prompt) - 1) rounded down to a block.
    (wl,) = build_workloads("tool_loop", SMALL)
    reqs = tokenize_workload(wl, qwen3)
    by_id = {r.request_id: r for r in reqs}
    bs, expected = 16, 0
    for r in reqs[1:]:
        ctx = by_id[r.parent].prompt + by_id[r.parent].output
        same = next((i for i, (a, b) in enumerate(zip(r.prompt, ctx)) if a != b), min(len(r.prompt), len(ctx)))
        expected += min(same // bs, (len(r.prompt) - 1) // bs) * bs
    result = simulate(reqs, SimConfig(block_size=bs, max_num_seqs=1))
    assert result.cached_tokens == expected
    assert result.hit_rate == pytest.approx(expected / sum(len(r.prompt) for r in reqs))


@pytest.mark.slow
def test_every_workload_renders_and_misses_add_up(qwen3):
    from benchmarks.prefix.bench import analyze

    for wl in build_workloads("all", SMALL):
        reqs = tokenize_workload(wl, qwen3)
        report, _ = analyze(wl.name, wl.description, reqs, SimConfig(block_size=16, capacity_blocks=64))
        assert sum(report["miss_causes"].values()) == report["prompt_tokens"] - report["cached_tokens"], wl.name
        assert 0 < report["ideal_hit_rate"] < 1
    assert set(WORKLOADS) - IMAGE_WORKLOADS == {w.name for w in build_workloads("all", SMALL)}


def test_thinking_on_names_dropped_reasoning_and_salts_cost_hits(qwen3):
    from benchmarks.prefix.bench import analyze

    cfg = SimConfig(block_size=16)
    reports = {wl.name: analyze(wl.name, wl.description, tokenize_workload(wl, qwen3), cfg)[0]
               for wl in build_workloads(["tool_loop", "tool_change", "tenants", "tenants_salted"], SMALL)}
    assert reports["tool_loop"]["main_miss_cause"] == CHANGE_REASONING
    assert reports["tool_change"]["miss_causes"][CHANGE_TOOLS] > 0
    assert reports["tenants_salted"]["main_miss_cause"] == "different_salt"
    assert reports["tenants_salted"]["hit_rate"] < reports["tenants"]["hit_rate"]


def test_projects_sessions_share_their_projects_head():
    (wl,) = build_workloads("projects", replace(SMALL, sessions=4, projects=2))
    first_turns = [r for r in wl.requests if r.turn == 0]
    assert len(first_turns) == 4 and len({r.session for r in wl.requests}) == 4
    heads = [r.messages[0]["content"] for r in first_turns]
    assert heads[0] == heads[2] != heads[1] == heads[3]
    assert first_turns[0].tools == first_turns[2].tools != first_turns[1].tools


@pytest.mark.slow
def test_cache_aware_compaction_keeps_the_head_and_computes_less_than_a_naive_one(qwen3):
    """Every epoch of compaction_aware starts with the same system prompt and tools, and its summary turn extends the
    conversation; compaction_naive rewrites the head each epoch: it computes more of its prompts, in the simulator
    as in `kvserve bench prefix` (docs/bench/RESULTS.md)."""
    params = replace(SMALL, compaction_every=3)
    aware, naive = build_workloads(["compaction_aware", "compaction_naive"], params)
    assert {(r.messages[0]["content"], str(r.tools)) for r in aware.requests} == {
        (aware.requests[0].messages[0]["content"], str(aware.requests[0].tools))}
    assert len({r.messages[0]["content"] for r in naive.requests}) > 2  # the head, the summariser's, each epoch's
    computed = {wl.name: sum(len(r.prompt) for r in reqs) - simulate(reqs, SimConfig(block_size=16)).cached_tokens
                for wl in (aware, naive) for reqs in [tokenize_workload(wl, qwen3)]}
    assert computed["compaction_naive"] > 1.2 * computed["compaction_aware"], computed
