"""Kimi-K3's output: the think channel the generation prompt opened, the response channel, a tools channel of
`call` blocks whose `argument`s carry their types, and `<|close|>message<|sep|>` ending the turn; the same message
under every split of the text, deltas that rebuild it, and the template's bytes back from the parsed message."""
import json

import pytest

from server.parsing import get_output_parser
from server.parsing.formats.kimi_k3 import KimiK3Format
from server.rendering import get_renderer
from server.rendering.native.kimi_k3 import render_calls

from tests.parsing.fixtures import TOOLS
from tests.parsing.streaming import argument_fragments, parse_checked

PROMPT_END = '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'


def k3(text: str, tools=TOOLS):
    factory = lambda: get_output_parser("kimi-k3", tools, reasoning=True, id_prefix="k")  # noqa: E731
    return parse_checked(factory, text)


def reply(reasoning: str, content: str, calls: list[dict] | None = None) -> str:
    """An assistant turn as the template renders it, from where the generation prompt leaves off."""
    message = {"role": "assistant", "content": content, "reasoning_content": reasoning}
    if calls:
        message["tool_calls"] = [{"id": f"c{i}", "type": "function", "function": f} for i, f in enumerate(calls)]
    rendered = get_renderer("kimi-k3").render([{"role": "user", "content": "hi"}, message], None, False)
    turn = rendered[rendered.index('<|open|>message role="assistant"'):]
    assert turn.startswith(PROMPT_END)
    return turn[len(PROMPT_END):]


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.tool_calls]


def test_parallel_typed_calls_round_trip_to_the_templates_bytes():
    calls = [{"name": "get_weather", "arguments": {"city": "東京", "unit": "c"}},
             {"name": "typed", "arguments": {"n": 3, "flag": True, "tags": ["a", "b"], "opts": {"x": None},
                                              "text": "3"}},
             {"name": "now", "arguments": {}}]
    text = reply("Two cities.\n", "Checking.", calls)
    message = k3(text + "<|end_of_msg|>")
    assert message.reasoning_content == "Two cities.\n" and message.content == "Checking."
    assert calls_of(message) == [(c["name"], c["arguments"]) for c in calls]
    again = [{"function": {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}}
             for c in message.tool_calls]
    assert render_calls(again) in text  # the next prompt holds the model's bytes


def test_an_answer_without_calls_is_the_response_channel():
    message = k3(reply("", "It is 18C.") + "<|end_of_msg|>" + '<|open|>message role="user"<|sep|>Thanks')
    assert message.content == "It is 18C." and message.tool_calls == [] and message.reasoning_content is None


def test_markup_inside_a_string_value_is_text_and_escaped_keys_read_back():
    code = 'print("<|close|>call<|sep|> <|close|>tools<|sep|>")'
    text = reply("", "", [{"name": "run", "arguments": {"code": code, 'say "hi" & go': 1}}])
    assert calls_of(k3(text)) == [("run", {"code": code, 'say "hi" & go': 1})]


def test_markup_in_prose_is_content():
    text = "Calls open with <|open|>call and the channel with <|open|>tools<|sep|>.<|close|>response<|sep|>"
    message = k3("<|close|>think<|sep|><|open|>response<|sep|>" + text)
    assert message.tool_calls == [] and message.content == text.removesuffix("<|close|>response<|sep|>")


def test_a_broken_call_is_content_and_a_call_after_it_is_found():
    broken = '<|open|>call tool="now" index="1" no head end<|close|>call<|sep|>'
    good = '<|open|>call tool="now" index="2"<|sep|><|close|>call<|sep|>'
    message = k3("<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>"
                 + broken + good + "<|close|>tools<|sep|>")
    assert calls_of(message) == [("now", {})]


def test_arguments_stream_per_argument():
    factory = lambda: get_output_parser("kimi-k3", TOOLS, reasoning=True, id_prefix="k")  # noqa: E731
    text = reply("", "", [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}])
    [fragments] = argument_fragments(factory, text)
    assert json.loads("".join(fragments)) == {"city": "Paris", "unit": "c"} and len(fragments) == 3


@pytest.mark.parametrize("cut", ['<|open|>call tool="get_weather" index="1"<|sep|><|open|>argument key="city" '
                                 'type="string"<|sep|>Par', '<|open|>call tool="get_wea'])
def test_a_call_cut_off_by_the_token_limit_is_valid_json(cut):
    parser = get_output_parser("kimi-k3", TOOLS, reasoning=True, id_prefix="k")
    parser.feed("<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>" + cut)
    parser.finish(cut=True)
    assert [json.loads(c["function"]["arguments"]) for c in parser.result().tool_calls] in ([], [{}])


def test_call_tags_are_the_templates():
    fmt = KimiK3Format(TOOLS)
    begin, end = fmt.block_tag()
    call_begin, call_end = fmt.call_tag("now")
    assert begin + call_begin + '1"<|sep|>' + call_end + end == render_calls([{"function": {"name": "now",
                                                                                            "arguments": {}}}])
