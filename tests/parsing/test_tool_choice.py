import json

import pytest

from server.parsing import get_output_parser, parse_tool_choice, ToolChoice

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
        get_output_parser("llama9", TOOLS, "auto", reasoning=False, id_prefix="p")


def test_tool_choice_none_parses_nothing_but_keeps_reasoning():
    text = '<think>\nr\n</think>\n\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    factory = lambda: get_output_parser("qwen3", TOOLS, "none", reasoning=True, id_prefix="p")  # noqa: E731
    message = parse_checked(factory, text)
    assert message.reasoning_content == "r" and message.tool_calls == []
    assert json.loads(message.content.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))["name"] == "now"
