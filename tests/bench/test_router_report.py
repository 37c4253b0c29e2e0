"""The router benchmark's arithmetic and its reading of vllm-router's log (the runs themselves:
tests/bench/test_router.py)."""
from __future__ import annotations

from datetime import datetime

from benchmarks.router_bench import (RoutedResult, fault_summary, ideal_cached_tokens, router_credits, router_log_facts,
                                     summarize)

VICTIM = "http://127.0.0.1:9002"


def test_summary_counts_hits_failures_and_placement():
    results = [RoutedResult("s0", 0, 0.0, 1.0, True, 1000, 0, 0), RoutedResult("s0", 1, 1.0, 1.5, True, 1200, 960, 0),
               RoutedResult("s1", 0, 0.5, 2.5, True, 800, 0, 1), RoutedResult("s1", 1, 2.5, 3.0, False, error="x")]
    s = summarize(results, replicas=2)
    assert (s["requests"], s["failed"], s["per_replica"]) == (4, 1, [2, 1])
    assert s["hit_rate"] == 960 / 3000 and s["later_turn_hit_rate"] == 960 / 1200
    assert s["ttft_p50_s"] == 1.0 and s["wall_s"] == 3.0


def test_fault_summary_splits_the_run_at_kill_and_restart():
    events = {"kill": 10.0, "restarted": 20.0}
    results = [RoutedResult("a", 0, 8.0, 11.0, True, 100, 50, 0),  # in flight at the kill, retried
               RoutedResult("b", 0, 9.0, 10.5, False, error="connection reset"),  # in flight, failed
               RoutedResult("a", 1, 12.0, 13.0, True, 200, 150, 0),  # while down
               RoutedResult("c", 0, 21.0, 22.0, True, 300, 0, 1)]  # after the restart, on the victim
    f = fault_summary(results, events, victim=1)
    assert (f["in_flight_at_kill"], f["in_flight_failed"], f["failed_outside_kill"]) == (2, 1, 0)
    assert (f["while_down"], f["while_down_to_victim"], f["after_restart_to_victim"]) == (1, 0, 1)
    assert f["hit_rate_while_down"] == 0.75 and f["errors"] == ["connection reset"]


def test_router_log_facts_read_decisions_after_the_restart():
    def line(stamp: str, text: str) -> str:  # vllm-router colours its log
        return f"\x1b[2m{stamp}\x1b[0m \x1b[34mDEBUG\x1b[0m {text}"

    log = "\n".join([
        line("2026-12-01 10:00:00", f'kv_aware: KV prefix decision outcome="prefix_cost" worker="{VICTIM}" '
             "input_tokens=900 new_prefill_tokens=100 credited_prefix_tokens=800 used_binding=false"),
        line("2026-12-01 10:00:01", 'router: KV request selected attempt=1 worker_url="http://127.0.0.1:9001"'),
        line("2026-12-01 10:00:20", "subscriber: kv_index kvserve-1: restart seq 0 < 7 -> incarnation 1"),
        line("2026-12-01 10:00:21", f'kv_aware: KV prefix decision outcome="prefix_cost" worker="{VICTIM}" '
             "input_tokens=900 new_prefill_tokens=900 credited_prefix_tokens=0 used_binding=false"),
        line("2026-12-01 10:00:22", f'kv_aware: KV prefix decision outcome="prefix_cost" worker="{VICTIM}" '
             "input_tokens=950 new_prefill_tokens=50 credited_prefix_tokens=896 used_binding=false"),
    ])
    restart = datetime(2026, 12, 1, 10, 0, 15).timestamp()
    facts = router_log_facts(log, VICTIM, restart)
    assert facts == {"retried_attempts": 1, "event_stream_restarts_detected": 1, "render_over_budget": 0,
                     "restarted_decisions": 2, "restarted_credited_tokens": 896}


def test_ideal_counts_what_prompts_answered_before_each_request_share_with_it():
    head = list(range(40))
    prompts = {("a", 0): head + [100, 101], ("a", 1): head + [100, 101, 102, 103, 104],
               ("b", 0): head[:20] + [7] * 30, ("b", 1): head + [9] * 10}
    results = [RoutedResult("a", 0, 0.0, 1.0, True, 42, 0, 0), RoutedResult("b", 0, 1.2, 2.0, True, 50, 0, 1),
               RoutedResult("a", 1, 1.0, 3.0, True, 45, 32, 0), RoutedResult("b", 1, 1.5, 4.0, True, 50, 16, 1)]
    ideal = ideal_cached_tokens(results, prompts, block_size=8)
    # a/1 shares 42 tokens with a/0 (its whole prompt): 40 in whole blocks. b/1 was sent before a/1 answered:
    # only a/0's 40-token head counts; b/0 (answered after b/1 was sent) does not
    assert ideal == {("a", 0): 0, ("b", 0): 16, ("a", 1): 40, ("b", 1): 40}
    assert ideal_cached_tokens(results[:1], {("a", 0): head}, 8) == {("a", 0): 0}


def test_router_credits_compare_the_decision_with_the_chosen_replicas_cache():
    urls = ["http://127.0.0.1:9001", VICTIM]

    def decision(url: str, tokens: int, credited: int) -> str:
        return (f'\x1b[2m2026-12-01 10:00:00\x1b[0m kv_aware: KV prefix decision outcome="prefix_cost" worker="{url}" '
                f"input_tokens={tokens} new_prefill_tokens={tokens - credited} credited_prefix_tokens={credited} x")

    log = "\n".join([decision(urls[0], 900, 800), decision(VICTIM, 700, 0), decision(urls[0], 500, 256),
                     "preprocess: Prefix input preparation unavailable worker=x"])
    results = [RoutedResult("a", 0, 0.0, 1.0, True, 900, 800, 0), RoutedResult("b", 0, 0.0, 1.0, True, 700, 512, 1),
               RoutedResult("c", 0, 0.0, 1.0, True, 500, 0, 0), RoutedResult("d", 0, 0.0, 1.0, True, 300, 0, 0)]
    assert router_credits(log, results, urls) == {
        "decisions_matched": 3, "credited_tokens": 1056, "cached_tokens": 1312, "credited_short": 1,
        "credited_over": 1, "render_over_budget": 1}
