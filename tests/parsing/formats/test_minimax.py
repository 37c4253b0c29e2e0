"""MiniMax-M2's output: `<think>` reasoning (the prompt opened it), a `<minimax:tool_call>` block of `<invoke name=…>`
calls with `<parameter name=…>` values typed by the tools' schemas, `[e~[` as the end of the reply; the same message
under every split of the text, and deltas that rebuild it."""
import json

import pytest

from server.parsing import get_output_parser
from server.parsing.formats.minimax_xml import MinimaxFormat
from server.rendering.native.minimax import render_calls

from tests.parsing.fixtures import TOOLS
from tests.parsing.streaming import argument_fragments, parse_checked


def minimax(text: str, reasoning: bool = True, tools=TOOLS, **kwargs):
    factory = lambda: get_output_parser("minimax-m2", tools, reasoning=reasoning, id_prefix="m", **kwargs)  # noqa: E731
    return parse_checked(factory, text)


def block(*calls: tuple[str, dict[str, str]]) -> str:
    """The calls as the template renders them, raw values as given."""
    return render_calls([{"function": {"name": name, "arguments": args}} for name, args in calls])


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.tool_calls]


def test_reasoning_content_and_parallel_calls():
    text = ("Two cities.\n</think>\n\nChecking both." + block(("get_weather", {"city": "Paris"}),
                                                              ("get_weather", {"city": "東京", "unit": "c"})) + "[e~[")
    message = minimax(text)
    assert message.reasoning_content == "Two cities."
    assert message.content == "Checking both."
    assert calls_of(message) == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "東京", "unit": "c"})]
    assert message.tool_calls[1]["function"]["arguments"] == '{"city": "東京", "unit": "c"}'


def test_values_typed_by_the_schema():
    args = {"count": "42", "ratio": "0.25", "flag": "true", "options": '{"a": [1, 2], "b": null}', "items": '["x"]',
            "nothing": "null", "text": "42", "maybe": "null", "either": "true", "undeclared": "7"}
    [(name, parsed)] = calls_of(minimax("ok</think>" + block(("typed", args))))
    assert name == "typed"
    assert parsed == {"count": 42, "ratio": 0.25, "flag": True, "options": {"a": [1, 2], "b": None}, "items": ["x"],
                      "nothing": None, "text": "42", "maybe": None, "either": True, "undeclared": "7"}


def test_raw_string_values_keep_markup_newlines_and_call_tags():
    code = 'if a < b:\n    print("</invoke> </minimax:tool_call> <parameter")\n'
    [(_, parsed)] = calls_of(minimax("</think>" + block(("get_weather", {"city": code}))))
    assert parsed == {"city": code}


def test_a_call_without_arguments_and_compact_layout():
    message = minimax('</think><minimax:tool_call><invoke name="now"></invoke><invoke name="get_weather">'
                      '<parameter name="city">Oslo</parameter></invoke></minimax:tool_call>')
    assert calls_of(message) == [("now", {}), ("get_weather", {"city": "Oslo"})]
    assert message.content is None


def test_the_reply_ends_at_the_end_of_turn_token():
    message = minimax("Easy.\n</think>\n\nIt is 18C.[e~[\n]~b]user\nThanks![e~[")
    assert message.content == "It is 18C." and message.tool_calls == [] and message.reasoning_content == "Easy."


def test_markup_in_prose_is_content():
    text = "</think>Calls go in <minimax:tool_call> blocks of <invoke> tags: <minimax:tool_call>none</minimax:tool_call>"
    message = minimax(text)
    assert message.tool_calls == []
    assert message.content == text.removeprefix("</think>")


def test_arguments_stream_per_completed_parameter():
    factory = lambda: get_output_parser("minimax-m2", TOOLS, reasoning=False, id_prefix="m")  # noqa: E731
    text = "</think>" + block(("get_weather", {"city": "Paris", "unit": "c"}))
    assert argument_fragments(factory, text) == [['{"city": "Paris"', ', "unit": "c"', "}"]]


def test_broken_markup_ends_the_arguments_and_a_repeated_key_keeps_its_first_value():
    text = ('</think><minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Rome</parameter>\n'
            '<parameter name="city">Nice</parameter>\noops<parameter name="unit">f</parameter>\n</invoke>\n'
            "</minimax:tool_call>")
    assert calls_of(minimax(text)) == [("get_weather", {"city": "Rome"})]


@pytest.mark.parametrize("cut", ['<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Par',
                                 '<minimax:tool_call>\n<invoke name="get_weather">\n<param'])
def test_a_call_cut_off_by_the_token_limit_is_valid_json(cut):
    parser = get_output_parser("minimax-m2", TOOLS, reasoning=False, id_prefix="m")
    parser.feed(cut)
    parser.finish(cut=True)
    assert [json.loads(c["function"]["arguments"]) for c in parser.result().tool_calls] in ([], [{}])


def test_call_tags_are_the_templates():
    fmt = MinimaxFormat(TOOLS)
    begin, end = fmt.block_tag()
    call_begin, call_end = fmt.call_tag("now")
    assert fmt.calls_prefix + begin + call_begin + call_end + end == block(("now", {}))
