"""DeepSeek-V3.2 and V4 have Python encoders instead of chat templates. The native renderers must equal them: on
DeepSeek's own V4 test conversations (tests/rendering/deepseek_v4_cases/, from the model repo's encoding folder), and
on random conversations with the official encoders (tests/rendering/templates/encoding_dsv*.py) run as the oracle."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server.rendering import Prepared, get_renderer
from tests.rendering.make_goldens import TEMPLATES, load_encoder

CASES = Path(__file__).resolve().parent / "deepseek_v4_cases"
ENCODERS = {"deepseek-v3.2": "encoding_dsv32.py", "deepseek-v4": "encoding_dsv4.py"}


@pytest.mark.parametrize(("number", "mode"), [(1, "thinking"), (2, "thinking"), (3, "thinking"), (4, "chat")])
def test_deepseeks_own_v4_cases(number: int, mode: str) -> None:
    data = json.loads((CASES / f"test_input_{number}.json").read_text(encoding="utf-8"))
    if isinstance(data, dict):  # case 1: the tools travel on the first message
        data["messages"][0]["tools"] = data["tools"]
        data = data["messages"]
    expected = (CASES / f"test_output_{number}.txt").read_text(encoding="utf-8")
    rendered = get_renderer("deepseek-v4").render_prepared(Prepared(data, None), True, {"thinking": mode == "thinking"})
    assert rendered == expected


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
TEXT = st.sampled_from(["", "Hi", "Paris?", "line\nbreak", "  padded ", "日本語", "<think>x</think>y"])
ARGS = st.sampled_from(['{"city": "Paris"}', '{"city": "Rome", "days": 3}', "{}", '{"days": [1, 2], "x": null}'])


@st.composite
def conversations(draw) -> tuple[list[dict], list[dict] | None, dict]:
    """A system prompt, then turns: a user message, or an assistant turn (text and/or reasoning, maybe calls whose
    results follow, in either order), or a reminder; and the template kwargs."""
    messages: list[dict] = [{"role": "system", "content": draw(TEXT)}] if draw(st.booleans()) else []
    for turn in range(draw(st.integers(1, 5))):
        kind = draw(st.sampled_from(["user", "user", "assistant", "calls", "reminder"]))
        if kind == "user":
            messages.append({"role": "user", "content": draw(TEXT)})
        elif kind == "reminder":
            messages.append({"role": "latest_reminder", "content": draw(TEXT)})
        else:
            message = {"role": "assistant", "content": draw(TEXT)}
            if draw(st.booleans()):
                message["reasoning_content"] = draw(TEXT)
            ids = [f"c{turn}_{i}" for i in range(draw(st.integers(1, 3)))] if kind == "calls" else []
            if ids:
                message["tool_calls"] = [{"id": i, "type": "function", "function": {
                    "name": "get_weather", "arguments": draw(ARGS)}} for i in ids]
            messages.append(message)
            for call_id in draw(st.permutations(ids)):
                messages.append({"role": "tool", "tool_call_id": call_id, "content": draw(TEXT)})
    kwargs = {"thinking": draw(st.booleans()), "drop_thinking": draw(st.booleans()),
              "reasoning_effort": draw(st.sampled_from([None, "high", "max"]))}
    return messages, [WEATHER] if draw(st.booleans()) else None, kwargs


@pytest.mark.parametrize("family", sorted(ENCODERS))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=conversations())
def test_native_renderer_equals_the_official_encoder(family: str, case) -> None:
    messages, tools, kwargs = case
    renderer = get_renderer(family)
    encoder = load_encoder(TEMPLATES / ENCODERS[family])
    try:
        prepared = renderer.prepare(messages, tools)
    except ValueError:
        return  # refused before the encoder (a reminder for V3.2): the server answers 400
    options = {"drop_thinking": kwargs["drop_thinking"]}
    if family == "deepseek-v4":
        options["reasoning_effort"] = kwargs["reasoning_effort"]
    try:
        mode = "thinking" if kwargs["thinking"] else "chat"
        expected = encoder.encode_messages(copy.deepcopy(prepared.messages), mode, **options)
    except Exception:  # noqa: BLE001 - what the encoder refuses, the renderer must refuse too
        with pytest.raises(ValueError):
            renderer.render_prepared(prepared, True, kwargs)
        return
    assert renderer.render_prepared(prepared, True, kwargs) == expected
