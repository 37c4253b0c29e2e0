"""gpt-oss' harmony output (server/parsing/formats/harmony.py): reasoning from ``analysis``, answers from ``final`` and
recipient-less ``commentary``, calls from messages to ``functions.NAME`` (recipient after the channel, as the model
writes it, or before, as the history renders it), the same result and deltas however the text is split; calls
streamed or held, cut calls closed or dropped, the call limit, and what the renderer writes parsed back."""
from __future__ import annotations

import json

import pytest

from server.parsing import get_output_parser, parse_output
from server.parsing.formats.harmony import HarmonyFormat, read_header
from server.rendering.native.harmony import call_header
from tests.parsing.streaming import parse_checked, run

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
ANALYSIS = "<|channel|>analysis<|message|>The user wants the weather. Call the tool.<|end|>"
CALL = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
        '{"city": "Paris"}<|call|>')
ANSWER = "<|start|>assistant<|channel|>final<|message|>It is <b>sunny</b> in Paris.<|return|>"


def parser(tools=TOOLS, tool_choice=None, streaming=True, max_calls=None):
    return lambda: get_output_parser("gpt-oss", tools, tool_choice, reasoning=True, id_prefix="p", streaming=streaming,
                                     max_calls=max_calls)


def test_reasoning_then_answer_split_anyhow():
    result = parse_checked(parser(), ANALYSIS + ANSWER)
    assert result.reasoning_content == "The user wants the weather. Call the tool."
    assert result.content == "It is <b>sunny</b> in Paris." and not result.tool_calls


@pytest.mark.parametrize("streaming", [True, False])
def test_reasoning_then_a_call(streaming):
    result = parse_checked(parser(streaming=streaming), ANALYSIS + CALL)
    assert result.reasoning_content.startswith("The user wants")
    assert result.content is None and result.finish_reason_override == "tool_calls"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in result.tool_calls] == [
        ("get_weather", {"city": "Paris"})]


def test_the_recipient_before_the_channel_and_a_preamble():
    text = ("<|channel|>commentary<|message|>Let me check.<|end|><|start|>assistant to=functions.get_weather"
            '<|channel|>commentary <|constrain|>json<|message|>{"city":"Oslo"}<|call|>')
    result = parse_checked(parser(), text)
    assert result.content == "Let me check." and result.tool_calls[0]["function"]["arguments"] == '{"city":"Oslo"}'
    assert read_header(" to=functions.f<|channel|>commentary <|constrain|>json") == ("commentary", "functions.f")
    assert read_header("<|channel|>analysis") == ("analysis", None) and read_header("") == ("final", None)


def test_what_the_renderer_writes_parses_back():
    rendered = call_header("get_weather").removeprefix("<|start|>assistant") + '{"city": "Rome"}<|call|>'
    begin, end = HarmonyFormat().call_tag("get_weather")
    assert rendered.startswith(" to=functions.get_weather<|channel|>")  # the history's order; the model's below
    model = begin + '{"city": "Rome"}' + end
    for text in (rendered, model):
        assert parse_output("gpt-oss", text, TOOLS, reasoning=True, id_prefix="x").tool_calls[0]["function"] == {
            "name": "get_weather", "arguments": '{"city": "Rome"}'}


def test_without_tool_parsing_a_call_is_text():
    result = parse_checked(parser(tools=None), ANALYSIS + CALL)
    assert result.content == '{"city": "Paris"}' and not result.tool_calls
    assert parse_checked(parser(tool_choice="none"), CALL).content == '{"city": "Paris"}'


def test_a_cut_call_is_closed_when_streamed_and_dropped_when_held():
    cut = ANALYSIS + CALL[: CALL.index("Paris")]
    p = parser()()
    p.feed(cut)
    p.finish(cut=True)
    assert json.loads(p.result().tool_calls[0]["function"]["arguments"]) == {"city": ""}
    held = parser(streaming=False)()
    held.feed(cut)
    held.finish(cut=True)
    assert held.result().tool_calls == [] and held.result().reasoning_content


def test_the_call_limit_ends_the_output():
    text = CALL.replace("<|call|>", "<|end|>") + CALL
    deltas, result = run(parser(max_calls=1), [text])
    assert len(result.tool_calls) == 1
    p = parser(max_calls=1)()
    p.feed(text)
    assert p.limited


def test_markers_inside_a_body_and_text_between_messages():
    text = ("<|channel|>final<|message|>Use <|channel|> to switch.<|end|>stray<|start|>assistant<|channel|>final"
            "<|message|> More.<|return|>ignored")
    assert parse_checked(parser(), text).content == "Use <|channel|> to switch. More."


def test_output_outside_the_format_is_text():
    assert parse_checked(parser(), "Just text, no header.").content == "Just text, no header."
    assert parse_checked(parser(), "Plain<|end|><|start|>assistant<|channel|>final<|message|> then framed").content == (
        "Plain then framed")
    assert parse_checked(parser(), "<|channel|>analy").content == ""  # a header the output cut off: nothing


def test_the_grammar_of_a_required_call_names_the_markers_as_tokens():
    """tool_choice required / named: the call in the harmony format, its markers the o200k_harmony special tokens
    (200005 <|channel|>, 200003 <|constrain|>, 200008 <|message|>, 200012 <|call|>), one call (it ends the turn);
    auto has no grammar (a call opens with a special token no text trigger sees)."""
    from server.parsing import output_constraint

    other = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}
    named = json.loads(output_constraint("gpt-oss", TOOLS, {"type": "function", "function": {"name": "get_weather"}},
                                         None, None, reasoning=True).value)["format"]
    assert [e.get("token", e.get("value")) for e in named["elements"] if e["type"] != "json_schema"] == [
        200005, "commentary to=functions.get_weather ", 200003, "json", 200008, 200012]
    required = json.loads(output_constraint("gpt-oss", TOOLS + [other], "required", None, None,
                                            reasoning=True).value)["format"]
    assert required["type"] == "or" and len(required["elements"]) == 2
    assert output_constraint("gpt-oss", TOOLS, "auto", None, None, reasoning=True) is None
