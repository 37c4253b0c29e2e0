"""Whether a request thinks, read from its template kwargs the way each family's template reads them."""
from __future__ import annotations

import pytest

from server.pipeline.plan import request_thinking


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
