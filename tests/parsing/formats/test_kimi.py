"""Kimi's output (Kimi-K2 / Kimi Linear): `<think>` reasoning the model opens itself, its text, then one
`<|tool_calls_section_begin|>` section of `<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{…}
<|tool_call_end|>` calls whose ids are the model's headers, `<|im_end|>` as the end of the reply; the same message
under every split of the text, and deltas that rebuild it."""
import json

import pytest

from server.parsing import get_output_parser
from server.parsing.formats.kimi import KimiFormat, function_name
from server.rendering.native.kimi import render_calls

from tests.parsing.fixtures import TOOLS
from tests.parsing.streaming import argument_fragments, parse_checked


def kimi(text: str, tools=TOOLS, **kwargs):
    factory = lambda: get_output_parser("kimi-k2", tools, reasoning=True, id_prefix="k", **kwargs)  # noqa: E731
    return parse_checked(factory, text)


def section(*calls: tuple[str, str]) -> str:
    """The calls as the template renders them: (id, arguments text)."""
    return render_calls([{"id": call_id, "function": {"name": "", "arguments": args}} for call_id, args in calls])


def calls_of(message) -> list[tuple[str, str, dict]]:
    return [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.tool_calls]


def test_reasoning_content_and_parallel_calls_keep_the_models_ids():
    text = ("<think>Two cities.</think>Checking both." + section(
        ("functions.get_weather:0", '{"city": "Paris"}'),
        ("functions.get_weather:1", '{"city":"東京","unit":"c"}')) + "<|im_end|>")
    message = kimi(text)
    assert message.reasoning_content == "Two cities." and message.content == "Checking both."
    assert calls_of(message) == [("functions.get_weather:0", "get_weather", {"city": "Paris"}),
                                 ("functions.get_weather:1", "get_weather", {"city": "東京", "unit": "c"})]
    assert message.tool_calls[1]["function"]["arguments"] == '{"city":"東京","unit":"c"}'  # the model's bytes


def test_markers_inside_string_values_are_text():
    code = 'print("<|tool_call_end|> <|tool_calls_section_end|>")'
    text = section(("functions.run:3", json.dumps({"code": code})))
    [(call_id, name, args)] = calls_of(kimi(text))
    assert (call_id, name, args) == ("functions.run:3", "run", {"code": code})


def test_names_without_the_prefix_or_the_index():
    assert function_name("functions.mcp.read_file:12") == "mcp.read_file"
    assert function_name("get_weather:0") == "get_weather"
    assert function_name("functions.now") == "now"
    assert calls_of(kimi(section(("now", "{}")))) == [("now", "now", {})]


def test_the_reply_ends_at_the_end_of_turn_token():
    message = kimi("<think></think>It is 18C.<|im_end|><|im_user|>user<|im_middle|>Thanks!")
    assert message.content == "It is 18C." and message.tool_calls == [] and message.reasoning_content is None


def test_markup_in_prose_is_content():
    text = "Sections open with <|tool_calls_section_begin|> and hold calls.<|tool_calls_section_end|> Done."
    message = kimi(text)
    assert message.tool_calls == [] and message.content == text


def test_a_broken_call_is_content_and_a_call_after_it_is_found():
    broken = "<|tool_calls_section_begin|><|tool_call_begin|>functions.now:0 no arguments<|tool_call_end|>"
    good = "<|tool_call_begin|>functions.now:1<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>"
    message = kimi(broken + good)
    assert calls_of(message) == [("functions.now:1", "now", {})]


def test_arguments_stream_as_written():
    factory = lambda: get_output_parser("kimi-k2", TOOLS, reasoning=True, id_prefix="k")  # noqa: E731
    fragments = argument_fragments(factory, section(("functions.get_weather:0", '{"city": "Paris"}')))
    assert len(fragments) == 1 and "".join(fragments[0]) == '{"city": "Paris"}' and len(fragments[0]) > 1


@pytest.mark.parametrize("cut", ['<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0'
                                 '<|tool_call_argument_begin|>{"city": "Par',
                                 "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_wea"])
def test_a_call_cut_off_by_the_token_limit_is_valid_json(cut):
    parser = get_output_parser("kimi-k2", TOOLS, reasoning=True, id_prefix="k")
    parser.feed(cut)
    parser.finish(cut=True)
    assert [json.loads(c["function"]["arguments"]) for c in parser.result().tool_calls] in ([], [{"city": "Par"}])


def test_call_tags_are_the_templates():
    fmt = KimiFormat(TOOLS)
    begin, end = fmt.block_tag()
    call_begin, call_end = fmt.call_tag("now")
    assert begin + call_begin + "0<|tool_call_argument_begin|>{}" + call_end + end == section(("functions.now:0", "{}"))
