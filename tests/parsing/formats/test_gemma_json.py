"""Gemma 3's output (server/parsing/formats/gemma_json.py): `{"name": …, "parameters": {…}}` calls a line apart,
`<end_of_turn>` ending the reply; the same message under every split of the text, deltas that rebuild it, JSON in
prose and in code fences left as content, and the calls the renderer writes read back."""
import json

from server.parsing import get_output_parser
from server.rendering import get_renderer
from server.rendering.native.gemma3 import call_text

from tests.parsing.fixtures import TOOLS
from tests.parsing.streaming import argument_fragments, parse_checked


def parser(tools=TOOLS, **kwargs):
    return lambda: get_output_parser("gemma3", tools, reasoning=False, id_prefix="g", **kwargs)  # noqa: E731


def call(name: str, arguments: str) -> str:
    return call_text({"name": name, "arguments": arguments})


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.tool_calls]


def test_parallel_calls_a_line_apart_and_the_end_of_turn():
    text = call("get_weather", '{"city": "Paris"}') + "\n" + call("get_weather", '{"city": "東京", "unit": "c"}') + \
        "<end_of_turn>\n<start_of_turn>user\nignored"
    message = parse_checked(parser(), text)
    assert message.content is None
    assert calls_of(message) == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "東京", "unit": "c"})]
    assert message.tool_calls[1]["function"]["arguments"] == '{"city": "東京", "unit": "c"}'  # the model's bytes


def test_text_before_a_call_and_a_name_written_with_escapes():
    message = parse_checked(parser(), "Let me look.\n" + call("get_weather", '{"city": "Oslo"}'))
    assert message.content == "Let me look." and calls_of(message) == [("get_weather", {"city": "Oslo"})]
    escaped = parse_checked(parser(), '{"name": "get\\u005fweather", "parameters": {"city": "Rome"}}')
    assert calls_of(escaped) == [("get_weather", {"city": "Rome"})]


def test_json_that_is_not_a_call_stays_content():
    for text in ('The user is {"name": "Ada", "age": 36} here.', 'Use {"name": "x"} and go.',
                 '```json\n{"name": "get_weather", "parameters": {"city": "Paris"}}\n```'):
        message = parse_checked(parser(), text)
        assert message.content == text and message.tool_calls == [], text
    # After such an object, a real call is still found.
    message = parse_checked(parser(), 'Not {"name": "Ada"}.\n' + call("get_weather", '{"city": "Nice"}'))
    assert message.content == 'Not {"name": "Ada"}.' and calls_of(message) == [("get_weather", {"city": "Nice"})]


def test_markup_inside_strings_is_argument_text():
    code = 'print({"name": "x", "parameters": {}})'
    message = parse_checked(parser(), call("get_weather", json.dumps({"city": code})))
    assert calls_of(message) == [("get_weather", {"city": code})]


def test_arguments_stream_and_a_cut_call_is_closed():
    fragments = argument_fragments(parser(), call("get_weather", '{"city": "Paris", "unit": "c"}'))
    assert len(fragments) == 1 and "".join(fragments[0]) == '{"city": "Paris", "unit": "c"}' and len(fragments[0]) > 3
    cut = parse_checked(parser(), '{"name": "get_weather", "parameters": {"city": "Pa')  # the output ended there
    assert calls_of(cut) == [("get_weather", {"city": "Pa"})]


def test_without_tools_everything_is_content():
    text = call("get_weather", '{"city": "Paris"}')
    assert parse_checked(parser(tools=None), text).content == text


def test_what_the_renderer_writes_reads_back():
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "On it.", "tool_calls": [
                    {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Nice"}'}},
                    {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Lyon"}}}]}]
    rendered = get_renderer("gemma3").render(messages, TOOLS, add_generation_prompt=False)
    reply = rendered[rendered.rindex("<start_of_turn>model\n") + len("<start_of_turn>model\n"):]
    message = parse_checked(parser(), reply)
    assert message.content == "On it."
    assert calls_of(message) == [("get_weather", {"city": "Nice"}), ("get_weather", {"city": "Lyon"})]
    assert message.tool_calls[0]["function"]["arguments"] == '{"city":"Nice"}'  # re-rendered as written
