import json

import pytest

from server.parsing import get_output_parser, parse_tool_choice, tool_call_prompt_suffix, ToolChoice
from server.parsing.deepseek import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, SEP

from tests.parsing.fixtures import TOOLS
from tests.parsing.streaming import parse_checked

NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_validation():
    assert parse_tool_choice(None, TOOLS) == ToolChoice("auto")
    assert parse_tool_choice(None, None) == ToolChoice("none")
    assert parse_tool_choice("auto", None) == ToolChoice("none")
    assert parse_tool_choice("required", TOOLS) == ToolChoice("required")
    assert parse_tool_choice(NAMED, TOOLS) == ToolChoice("function", "get_weather")
    with pytest.raises(ValueError, match="'missing', which is not in tools"):
        parse_tool_choice({"type": "function", "function": {"name": "missing"}}, TOOLS)
    with pytest.raises(ValueError, match="needs at least one tool"):
        parse_tool_choice("required", [])
    for bad in ("sometimes", {"type": "function"}, {"type": "other"}, 3):
        with pytest.raises(ValueError):
            parse_tool_choice(bad, TOOLS)
    with pytest.raises(ValueError, match="unknown template family"):
        tool_call_prompt_suffix("llama9", "auto", TOOLS)


@pytest.mark.parametrize(
    "family,reasoning,expected",
    [
        ("qwen2.5", False, '<tool_call>\n{"name": "get_weather", "arguments": '),
        ("qwen3", True, '<tool_call>\n{"name": "get_weather", "arguments": '),
        ("jinja", False, '<tool_call>\n{"name": "get_weather", "arguments": '),
        ("qwen3-coder", False, "<tool_call>\n<function=get_weather>\n"),
        ("deepseek-v3", False, f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_weather\n```json\n"),
        ("deepseek-r1", True, f"\n</think>\n\n{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_weather\n```json\n"),
        ("deepseek-r1-0528", True, f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_weather\n```json\n"),
        ("deepseek-v3.1", False, f"{CALLS_BEGIN}{CALL_BEGIN}get_weather{SEP}"),
        ("deepseek-v3.1", True, f"</think>{CALLS_BEGIN}{CALL_BEGIN}get_weather{SEP}"),
    ],
)
def test_named_function_suffix(family, reasoning, expected):
    assert tool_call_prompt_suffix(family, NAMED, TOOLS, reasoning=reasoning) == expected


def test_required_suffix_and_auto_none_are_empty():
    assert tool_call_prompt_suffix("qwen3", "required", TOOLS) == "<tool_call>\n"
    assert tool_call_prompt_suffix("qwen3-coder", "required", TOOLS) == "<tool_call>\n<function="
    assert tool_call_prompt_suffix("deepseek-v3.1", "required", TOOLS) == CALLS_BEGIN + CALL_BEGIN
    assert tool_call_prompt_suffix("qwen3", "auto", TOOLS) == ""
    assert tool_call_prompt_suffix("qwen3", "none", TOOLS) == ""


# What each model writes after the named-function prefix, up to its end of turn.
CONTINUATIONS = {
    "qwen2.5": ('{"city": "Paris"}}\n</tool_call><|im_end|>', '{"city": "Paris"}'),
    "qwen3": ('{"city": "Paris"}}\n</tool_call><|im_end|>', '{"city": "Paris"}'),
    "qwen3-coder": ("<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call><|im_end|>", '{"city": "Paris"}'),
    "deepseek-v3": ('{"city": "Paris"}\n```' + CALL_END + CALLS_END + "<｜end▁of▁sentence｜>", '{"city": "Paris"}'),
    "deepseek-r1": ('{"city": "Paris"}\n```' + CALL_END + CALLS_END, '{"city": "Paris"}'),
    "deepseek-v3.1": ('{"city": "Paris"}' + CALL_END + CALLS_END + "<｜end▁of▁sentence｜>", '{"city": "Paris"}'),
}


@pytest.mark.parametrize("family", list(CONTINUATIONS))
@pytest.mark.parametrize("reasoning", [False, True])
def test_parser_primed_with_the_forced_prefix_carries_the_call(family, reasoning):
    output, arguments = CONTINUATIONS[family]
    factory = lambda: get_output_parser(family, TOOLS, NAMED, reasoning=reasoning, id_prefix="p")  # noqa: E731
    message = parse_checked(factory, output)
    assert message.reasoning_content is None and message.content is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message.tool_calls] == [
        ("get_weather", arguments)
    ]
    assert message.finish_reason_override == "tool_calls"


def test_required_lets_the_model_pick_and_add_more_calls():
    output = (
        'now", "arguments": {}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "X"}}\n</tool_call>'
    )
    factory = lambda: get_output_parser("qwen3", TOOLS, "required", reasoning=True, id_prefix="p")  # noqa: E731
    message = parse_checked(factory, '{"name": "' + output)
    assert [c["function"]["name"] for c in message.tool_calls] == ["now", "get_weather"]


def test_forced_call_the_model_breaks_becomes_content_with_the_prefix():
    factory = lambda: get_output_parser("qwen2.5", TOOLS, NAMED, reasoning=False, id_prefix="p")  # noqa: E731
    message = parse_checked(factory, "oops")
    assert message.tool_calls == []
    assert message.content == '<tool_call>\n{"name": "get_weather", "arguments": oops'


def test_tool_choice_none_parses_nothing_but_keeps_reasoning():
    text = '<think>\nr\n</think>\n\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    factory = lambda: get_output_parser("qwen3", TOOLS, "none", reasoning=True, id_prefix="p")  # noqa: E731
    message = parse_checked(factory, text)
    assert message.reasoning_content == "r" and message.tool_calls == []
    assert json.loads(message.content.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))["name"] == "now"
