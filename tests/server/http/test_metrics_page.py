"""The /metrics page: Prometheus text, cumulative histograms, quoted labels."""
from __future__ import annotations

from engine.outputs import SchedulerStats
from server.http.metrics import Histogram, Metrics


def test_histogram_buckets_are_cumulative_with_inf() -> None:
    hist = Histogram(buckets=(0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 3.0):
        hist.observe(value)
    assert hist.lines("h") == ['h_bucket{le="0.1"} 2', 'h_bucket{le="1.0"} 3', 'h_bucket{le="+Inf"} 4',
                               "h_sum 3.65", "h_count 4"]


def test_metrics_render_snapshot_and_finish_reasons() -> None:
    metrics = Metrics('m"x')
    metrics.update(SchedulerStats(kv_blocks_total=8, kv_blocks_free=5, prefix_cache_hits_tokens=12))
    metrics.observe_finished("stop", 0.2, 1.5)
    metrics.observe_finished("abort", None, None)
    text = metrics.render()
    assert 'kvserve_kv_blocks_total{model="m\\"x"} 8' in text
    assert 'kvserve_prefix_cache_hits_tokens_total{model="m\\"x"} 12' in text
    assert 'kvserve_requests_finished_total{model="m\\"x",finish_reason="abort"} 1' in text
    assert 'kvserve_time_to_first_token_seconds_count{model="m\\"x"} 1' in text
    assert 'kvserve_e2e_request_latency_seconds_bucket{model="m\\"x",le="2.5"} 1' in text
