"""Simulator and miss attribution on hand-built token requests whose hit rates are computed by hand."""
from __future__ import annotations

import pytest

from benchmarks.prefix.attribution import attribute, summarize
from benchmarks.prefix.simulator import SimConfig, simulate
from benchmarks.prefix.traces.trace import TokenRequest
from server.cache.miss_causes import CHANGE_TOOLS

BS = 4


def constructed() -> list[TokenRequest]:
    a = TokenRequest("A", "s1", prompt=list(range(1, 11)), output=[11, 12, 13])
    b = TokenRequest("B", "s1", prompt=list(range(1, 19)), parent="A", turn=1)
    c = TokenRequest("C", "s2", prompt=[*range(1, 9), 99])
    d = TokenRequest("D", "s3", prompt=[*range(1, 9), 99], salt="tenant-x")
    return [a, b, c, d]


def test_ideal_hit_rate_by_hand():
    # A: cold. B: A's prompt + reply (13 ids) -> 3 full blocks = 12. C: 9 tokens, at most (9-1)//4 = 2 blocks = 8.
    # D: same tokens as C under another salt -> 0.   12 + 8 = 20 of 10 + 18 + 9 + 9 = 46 prompt tokens.
    result = simulate(constructed(), SimConfig(block_size=BS, max_num_seqs=1))
    assert [r.cached_tokens for r in result.results] == [0, 12, 8, 0]
    assert result.hit_rate == pytest.approx(20 / 46)


def test_salt_blind_and_no_output_commit():
    assert simulate(constructed(), SimConfig(block_size=BS, max_num_seqs=1, ignore_salts=True)).cached_tokens == 28
    # Without the reply cached, B only finds A's 10 prompt tokens: 2 full blocks.
    no_reply = simulate(constructed(), SimConfig(block_size=BS, max_num_seqs=1, commit_outputs=False))
    assert no_reply.by_id["B"].cached_tokens == 8


def test_same_step_requests_do_not_share_new_blocks():
    # C and D unsalted in one batch: C's blocks are not computed yet when D is admitted.
    reqs = constructed()[2:]
    reqs[1].salt = None
    assert simulate(reqs, SimConfig(block_size=BS, max_num_seqs=2)).cached_tokens == 0
    assert simulate(reqs, SimConfig(block_size=BS, max_num_seqs=1)).cached_tokens == 8


def test_capacity_evicts_and_attribution_says_so():
    reqs = constructed()
    cfg = SimConfig(block_size=BS, max_num_seqs=1, capacity_blocks=0)
    achieved = simulate(reqs, cfg)
    assert achieved.cached_tokens == 0 and achieved.evictions > 0
    ideal = simulate(reqs, SimConfig(block_size=BS, max_num_seqs=1))
    no_salt = simulate(reqs, SimConfig(block_size=BS, max_num_seqs=1, ignore_salts=True))
    misses = attribute(reqs, achieved, ideal, no_salt)
    assert summarize(misses)["evicted"] == 20


def test_attribution_by_hand():
    reqs = constructed()
    cfg = SimConfig(block_size=BS, max_num_seqs=1)
    runs = [simulate(reqs, cfg), simulate(reqs, cfg), simulate(reqs, SimConfig(block_size=BS, max_num_seqs=1, ignore_salts=True))]
    misses = {m.request_id: dict(m.causes) for m in attribute(reqs, *runs)}
    assert misses["A"] == {"first_request": 10}
    # B: 12 cached; its parent's context has 13 ids, so 1 is lost to block rounding, 5 are new this turn.
    assert misses["B"] == {"block_granularity": 1, "new_tokens": 5}
    assert misses["C"] == {"first_request": 1}
    assert misses["D"] == {"different_salt": 8, "first_request": 1}
    for m in attribute(reqs, *runs):
        assert sum(m.causes.values()) == m.prompt_tokens - m.cached_tokens


def test_divergence_is_charged_to_the_change():
    base = TokenRequest("A", "s", prompt=list(range(100, 140)))
    changed = TokenRequest("B", "s", prompt=[100, 101, 102, 103, 104, 7, *range(106, 150)], parent="A", turn=1,
                           change=CHANGE_TOOLS)
    reqs = [base, changed]
    cfg = SimConfig(block_size=BS, max_num_seqs=1, commit_outputs=False)
    runs = [simulate(reqs, cfg) for _ in range(3)]
    (_, b) = attribute(reqs, *runs)
    # Block 0 (4 tokens) still hits; the rest of the 40-token old context is lost to the tool change; 10 are new.
    assert b.cached_tokens == 4
    assert dict(b.causes) == {"tool_list": 36, "new_tokens": 10}


def test_parents_run_first_and_arrivals_wait():
    reqs = [TokenRequest("late", "s2", prompt=[1, 2, 3, 4, 5], arrival=5),
            TokenRequest("x", "s1", prompt=[1, 2, 3, 4, 9])]
    result = simulate(reqs, SimConfig(block_size=BS, max_num_seqs=4))
    assert result.by_id["x"].start == 0 and result.by_id["late"].start == 5  # one time unit per step
    assert result.by_id["late"].step == 1  # the second step: the simulator jumped to its arrival
    assert result.by_id["late"].cached_tokens == 4
    with pytest.raises(ValueError):
        simulate([TokenRequest("c", "s", [1], parent="p"), TokenRequest("p", "s", [1])], SimConfig())


def test_longest_prefix_policy_runs_the_warm_request_first():
    warm = list(range(1, 17))
    reqs = [TokenRequest("seed", "s0", prompt=warm + [0]),
            TokenRequest("cold", "s1", prompt=list(range(50, 70)), arrival=1),
            TokenRequest("hot", "s2", prompt=warm + [1, 2, 3], arrival=1)]
    fcfs = simulate(reqs, SimConfig(block_size=BS, max_num_seqs=1, policy="fcfs"))
    lp = simulate(reqs, SimConfig(block_size=BS, max_num_seqs=1, policy="longest_prefix"))
    assert fcfs.by_id["cold"].step < fcfs.by_id["hot"].step
    assert lp.by_id["hot"].step < lp.by_id["cold"].step
