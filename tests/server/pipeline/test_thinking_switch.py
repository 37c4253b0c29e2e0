"""Whether a request thinks, read from its template kwargs the way each family's template reads them."""
from __future__ import annotations

import pytest

from server.pipeline.plan import effort_kwargs, request_thinking
from server.rendering import get_renderer


@pytest.mark.parametrize(("family", "kwargs", "expected"), [
    ("qwen3", {}, True),
    ("qwen3", {"enable_thinking": False}, False),
    ("qwen3", {"enable_thinking": None}, True),  # the template only turns it off for an explicit false
    ("deepseek-v3.1", {}, False),
    ("deepseek-v3.1", {"thinking": True}, True),
    ("glm-4.7", {}, True),  # GLM-4.7 thinks unless told not to
    ("glm-4.7", {"enable_thinking": False}, False),
    ("gemma4", {}, False),  # Gemma 4 thinks only for a truthy enable_thinking
    ("gemma4", {"enable_thinking": None}, False),
    ("gemma4", {"enable_thinking": True}, True),
    ("jinja", {}, False),
])
def test_request_thinking_reads_kwargs_like_the_templates(family: str, kwargs: dict, expected: bool) -> None:
    assert request_thinking(family, kwargs) is expected


def test_a_reasoning_effort_switches_glm_thinking_with_its_kwarg() -> None:
    assert effort_kwargs("glm-4.7", "none") == {"enable_thinking": False}
    assert effort_kwargs("glm-4.7", "high") == {"enable_thinking": True}


def test_a_reasoning_effort_switches_gemma4_thinking_as_its_template_reads_it() -> None:
    """Gemma 4's template reads no effort: an effort turns `enable_thinking` on (the system turn opens with
    <|think|>) or, for none / minimal, off (the generation prompt closes an empty thought)."""
    renderer, messages = get_renderer("gemma4"), [{"role": "user", "content": "Hi"}]
    on, off = effort_kwargs("gemma4", "low"), effort_kwargs("gemma4", "minimal")
    assert (on, off) == ({"enable_thinking": True}, {"enable_thinking": False})
    user = "<|turn>user\nHi<turn|>\n<|turn>model\n"
    assert renderer.render(messages, **on) == "<bos><|turn>system\n<|think|><turn|>\n" + user
    assert renderer.render(messages, **off) == "<bos>" + user + "<|channel>thought\n<channel|>"


def test_a_reasoning_effort_is_kimi_k3s_thinking_effort() -> None:
    """Kimi-K3 always thinks (kvserve does not switch it off), at the effort its template states in a system note:
    max unless a request's effort says otherwise, none / minimal as low."""
    renderer, messages = get_renderer("kimi-k3"), [{"role": "user", "content": "Hi"}]
    assert [effort_kwargs("kimi-k3", e) for e in ("minimal", "medium", "xhigh")] == [
        {"thinking_effort": "low"}, {"thinking_effort": "medium"}, {"thinking_effort": "max"}]
    assert request_thinking("kimi-k3", {}) and request_thinking("kimi-k3", effort_kwargs("kimi-k3", "none"))
    note = "Now the system is invoked with `thinking_effort={}`."
    assert note.format("max") in renderer.render(messages)
    assert note.format("low") in renderer.render(messages, **effort_kwargs("kimi-k3", "low"))
