"""DeepSeek-V3.2 and V4 have Python encoders instead of chat templates. The native renderers must equal them: on
DeepSeek's own V4 test conversations (tests/rendering/deepseek_v4_cases/, from the model repo's encoding folder), and
on random conversations with the official encoders (tests/rendering/templates/encoding_dsv*.py) run as the oracle."""
from __future__ import annotations

import copy
import json
from collections import Counter
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


# Of the 150 generated conversations per family, at least this many must be rendered and compared with the encoder
# (70-100 for V3.2, whose renderer refuses the reminders, and all 150 for V4): a renderer that refused everything
# cannot pass.
MIN_RENDERED = 45


def _refused_before_the_encoder(family: str, messages: list[dict]) -> bool:
    """What the renderer may refuse before the encoder runs: a `latest_reminder` message, which only V4 knows (the
    server answers 400). Anything else the conversations strategy makes, both renderers must accept."""
    return family == "deepseek-v3.2" and any(m["role"] == "latest_reminder" for m in messages)


def check_case(family: str, case) -> str:
    """One conversation through the renderer and the official encoder; returns what happened: "rendered" (equal
    output), "refused by both", or "refused before the encoder" (only where `_refused_before_the_encoder` allows)."""
    messages, tools, kwargs = case
    renderer = get_renderer(family)
    encoder = load_encoder(TEMPLATES / ENCODERS[family])
    try:
        prepared = renderer.prepare(messages, tools)
    except ValueError as exc:
        assert _refused_before_the_encoder(family, messages), f"the renderer refused a valid conversation: {exc}"
        return "refused before the encoder"
    assert not _refused_before_the_encoder(family, messages), "the renderer accepted what it must refuse"
    options = {"drop_thinking": kwargs["drop_thinking"]}
    if family == "deepseek-v4":
        options["reasoning_effort"] = kwargs["reasoning_effort"]
    try:
        mode = "thinking" if kwargs["thinking"] else "chat"
        expected = encoder.encode_messages(copy.deepcopy(prepared.messages), mode, **options)
    except Exception:  # noqa: BLE001 - what the encoder refuses, the renderer must refuse too
        with pytest.raises(ValueError):
            renderer.render_prepared(prepared, True, kwargs)
        return "refused by both"
    assert renderer.render_prepared(prepared, True, kwargs) == expected
    return "rendered"


@pytest.mark.parametrize("family", sorted(ENCODERS))
@pytest.mark.slow
def test_native_renderer_equals_the_official_encoder(family: str) -> None:
    outcomes: Counter[str] = Counter()

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
    @given(case=conversations())
    def check(case) -> None:
        outcomes[check_case(family, case)] += 1

    check()
    assert outcomes["rendered"] >= MIN_RENDERED, outcomes


REMINDER = [{"role": "user", "content": "Hi"}, {"role": "latest_reminder", "content": "Paris?"}]
TWO_REPLIES = [{"role": "assistant", "content": ""}, {"role": "assistant", "content": ""}]  # no user turn
THINKING = {"thinking": True, "drop_thinking": False, "reasoning_effort": None}


@pytest.mark.parametrize(("family", "messages", "outcome"), [
    ("deepseek-v3.2", REMINDER, "refused before the encoder"),
    ("deepseek-v4", REMINDER, "rendered"),
    ("deepseek-v3.2", TWO_REPLIES, "refused by both"),  # in thinking mode, a reply after no user turn
])
def test_each_outcome_happens_where_it_should(family: str, messages: list[dict], outcome: str) -> None:
    """The refusal paths of `check_case`, each on a conversation that takes it (the random run may not)."""
    assert check_case(family, (messages, None, THINKING)) == outcome
