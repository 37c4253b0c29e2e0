"""The server's small pure pieces: tenant salts, the metrics page, the thinking switch, validation errors."""
from __future__ import annotations

import pytest

from server.cache.cache_salt import effective_salt, tenant_salt
from server.pipeline.plan import request_thinking
from server.http.http_io import parse_body
from engine.outputs import SchedulerStats
from server.http.metrics import Histogram, Metrics
from server.api.protocol import APIError, ChatCompletionRequest


def test_tenant_salts_are_stable_distinct_and_not_the_key() -> None:
    assert tenant_salt(None) is None
    a, b = tenant_salt("sk-a"), tenant_salt("sk-b")
    assert a == tenant_salt("sk-a") and a != b and "sk-a" not in a


def test_request_salt_is_scoped_inside_the_tenant_and_needs_permission() -> None:
    tenant = tenant_salt("sk-a")
    assert effective_salt(tenant, None, allow_request_salt=False) == tenant
    with pytest.raises(APIError) as err:
        effective_salt(tenant, "user-1", allow_request_salt=False)
    assert err.value.status == 400 and err.value.param == "cache_salt"
    scoped = effective_salt(tenant, "user-1", allow_request_salt=True)
    assert scoped != effective_salt(tenant_salt("sk-b"), "user-1", allow_request_salt=True)
    assert scoped != effective_salt(None, "user-1", allow_request_salt=True)
    # No way to spell one tenant's scoped salt from another tenant (or from no tenant).
    assert effective_salt(None, f"{len(tenant)}:{tenant}:user-1", allow_request_salt=True) != scoped


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


@pytest.mark.parametrize(("family", "kwargs", "expected"), [
    ("qwen3", {}, True),
    ("qwen3", {"enable_thinking": False}, False),
    ("qwen3", {"enable_thinking": None}, True),  # the template only turns it off for an explicit false
    ("deepseek-v3.1", {}, False),
    ("deepseek-v3.1", {"thinking": True}, True),
    ("jinja", {}, False),
])
def test_request_thinking_reads_kwargs_like_the_templates(family: str, kwargs: dict, expected: bool) -> None:
    assert request_thinking(family, kwargs) is expected


def test_validation_errors_name_the_field() -> None:
    with pytest.raises(APIError) as err:
        parse_body(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "top_p": 2})
    assert err.value.status == 400 and err.value.param == "top_p"
    with pytest.raises(APIError) as err:
        parse_body(ChatCompletionRequest, {"messages": [1]})
    assert err.value.param == "messages.0"
    # Unknown fields are ignored: agents send OpenAI options the server does not use.
    req = parse_body(ChatCompletionRequest, {"messages": [{"role": "user"}], "parallel_tool_calls": True})
    assert req.n == 1
