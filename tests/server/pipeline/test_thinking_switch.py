"""Whether a request thinks, read from its template kwargs the way each family's template reads them."""
from __future__ import annotations

import pytest

from server.pipeline.plan import effort_kwargs, request_thinking


@pytest.mark.parametrize(("family", "kwargs", "expected"), [
    ("qwen3", {}, True),
    ("qwen3", {"enable_thinking": False}, False),
    ("qwen3", {"enable_thinking": None}, True),  # the template only turns it off for an explicit false
    ("deepseek-v3.1", {}, False),
    ("deepseek-v3.1", {"thinking": True}, True),
    ("glm-4.7", {}, True),  # GLM-4.7 thinks unless told not to
    ("glm-4.7", {"enable_thinking": False}, False),
    ("jinja", {}, False),
])
def test_request_thinking_reads_kwargs_like_the_templates(family: str, kwargs: dict, expected: bool) -> None:
    assert request_thinking(family, kwargs) is expected


def test_a_reasoning_effort_switches_glm_thinking_with_its_kwarg() -> None:
    assert effort_kwargs("glm-4.7", "none") == {"enable_thinking": False}
    assert effort_kwargs("glm-4.7", "high") == {"enable_thinking": True}
