"""Normalization of OpenAI messages (server.rendering.messages) and why the renderers need it."""
from __future__ import annotations

from pathlib import Path

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from server.rendering import get_renderer
from server.rendering.messages import MessagePolicy, flatten_content, normalize_messages, normalize_tools
from tests.rendering.make_goldens import OFFICIAL

TEMPLATES = Path(__file__).resolve().parent / "templates"


def call_message(arguments, content=None) -> list[dict]:
    return [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": content,
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
    ]


def test_flatten_content() -> None:
    assert flatten_content(None, "m") == ""
    assert flatten_content("x", "m") == "x"
    assert flatten_content([{"type": "text", "text": "a"}, "b", {"type": "input_text", "text": "c"}], "m") == "a\nb\nc"
    with pytest.raises(ValueError, match="image_url"):
        flatten_content([{"type": "image_url", "image_url": {"url": "u"}}], "m")
    with pytest.raises(ValueError, match="string 'text'"):
        flatten_content([{"type": "text"}], "m")
    with pytest.raises(ValueError):
        flatten_content(3, "m")


@pytest.mark.parametrize(
    ("policy", "given", "expected"),
    [
        (MessagePolicy("string"), {"city": "Köln"}, '{"city": "Köln"}'),
        (MessagePolicy("string"), '{"city":"Köln"}', '{"city":"Köln"}'),
        (MessagePolicy("object"), '{"city": "Köln"}', {"city": "Köln"}),
        (MessagePolicy("object"), "", {}),
        (MessagePolicy("object", lenient_object_arguments=True), "{oops", "{oops"),
        (MessagePolicy("as_given"), '{"a":1}', '{"a":1}'),
        (MessagePolicy("as_given"), {"a": 1}, {"a": 1}),
        (MessagePolicy("as_given"), None, {}),
    ],
)
def test_argument_forms(policy: MessagePolicy, given, expected) -> None:
    out = normalize_messages(call_message(given), policy)
    assert out[1]["tool_calls"][0]["function"]["arguments"] == expected


@pytest.mark.parametrize("bad", ["{oops", "[1, 2]", "3"])
def test_object_policy_rejects_non_objects(bad: str) -> None:
    with pytest.raises(ValueError, match=r"messages\[1\]\.tool_calls\[0\]\.function\.arguments"):
        normalize_messages(call_message(bad), MessagePolicy("object"))


def test_message_shapes() -> None:
    messages = [
        {"role": "developer", "content": "rules"},
        {"role": "user", "content": None, "name": "bob"},
        {"role": "assistant", "content": "x", "tool_calls": [], "reasoning": "r"},
        {"role": "assistant", "content": "y", "tool_calls": None, "reasoning_content": None, "prefix": True},
        {"role": "tool", "content": [{"type": "text", "text": "18C"}], "tool_call_id": "c1"},
    ]
    assert normalize_messages(messages, MessagePolicy()) == [
        {"role": "system", "content": "rules"},
        {"role": "user", "content": "", "name": "bob"},
        {"role": "assistant", "content": "x", "reasoning_content": "r"},
        {"role": "assistant", "content": "y", "prefix": True},
        {"role": "tool", "content": "18C", "tool_call_id": "c1"},
    ]


def test_null_content_with_calls_policy_and_defaults() -> None:
    out = normalize_messages(call_message('{"a": 1}', content="text"), MessagePolicy("string", null_content_with_calls=True))
    assert out[1]["content"] is None
    out = normalize_messages(call_message('{"a": 1}'), MessagePolicy("string"))
    assert out[1]["content"] == "" and out[1]["tool_calls"][0]["type"] == "function"


@pytest.mark.parametrize(
    "messages",
    [[], "hi", [{"role": "robot", "content": "x"}], [{"content": "x"}], [["user", "x"]],
     [{"role": "assistant", "content": "", "tool_calls": {"not": "a list"}}]],
)
def test_invalid_messages(messages) -> None:
    with pytest.raises(ValueError):
        normalize_messages(messages, MessagePolicy())


def test_tools_validation_keeps_order_and_extra_keys() -> None:
    tools = [{"type": "function", "function": {"name": "f", "strict": True, "description": None}}]
    assert normalize_tools(tools) is tools
    assert normalize_tools([]) is None and normalize_tools(None) is None
    for bad in ({"type": "function"}, [{"type": "retrieval", "function": {"name": "f"}}],
                [{"type": "function", "function": {"name": "f", "parameters": "schema"}}]):
        with pytest.raises(ValueError):
            normalize_tools(bad)


def official(family: str, messages: list[dict]) -> str:
    filename, tokens = OFFICIAL[family]
    rendered, _ = render_jinja_template([messages], chat_template=(TEMPLATES / filename).read_text(encoding="utf-8"),
                                        add_generation_prompt=True, **tokens)
    return rendered[0]


@pytest.mark.parametrize(
    ("family", "messages"),
    [
        ("qwen3", call_message('{"a": 1}', content=None)),  # `'</think>' in None`
        ("qwen3-coder", call_message('{"a": 1}')),  # `arguments|items` on a string
        ("deepseek-v3.1", call_message({"a": 1}, content="")),  # str + dict
        ("deepseek-r1-0528", call_message('{"a": 1}', content=None)),  # `'</think>' in None`
    ],
)
def test_official_templates_crash_on_raw_requests_that_we_render(family: str, messages: list[dict]) -> None:
    with pytest.raises(Exception):  # noqa: B017 - TypeError or a Jinja error, depending on the template
        official(family, messages)
    renderer = get_renderer(family)
    assert renderer.render(messages) == official(family, renderer.prepare(messages).messages)


def test_deepseek_v3_keeps_calls_that_the_template_would_drop() -> None:
    messages = call_message('{"city": "Paris"}', content="")
    assert "get_weather" not in official("deepseek-v3", messages)  # content "" silently drops the call
    assert "get_weather" in get_renderer("deepseek-v3").render(messages)
