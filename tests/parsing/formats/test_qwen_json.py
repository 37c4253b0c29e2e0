import json

import pytest

from server.parsing import Delta, get_output_parser

from tests.parsing.fixtures import TOOLS
from tests.parsing.streaming import argument_fragments, parse_checked, run


def qwen(text: str, family: str = "qwen2.5", tools=TOOLS, **kwargs):
    factory = lambda: get_output_parser(family, tools, reasoning=False, id_prefix="t", **kwargs)  # noqa: E731
    return parse_checked(factory, text)


def call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def names_and_args(message):
    return [(c["function"]["name"], c["function"]["arguments"]) for c in message.tool_calls]


def test_plain_text():
    message = qwen("Hello, **world**!\nA < b and c > d.<|im_end|>")
    assert message.content == "Hello, **world**!\nA < b and c > d."
    assert message.tool_calls == [] and message.finish_reason_override is None
    assert message.reasoning_content is None


def test_one_call_keeps_the_argument_bytes():
    message = qwen(call("get_weather", '{"city": "Paris",  "unit":"c"}') + "<|im_end|>")
    assert message.content is None
    assert names_and_args(message) == [("get_weather", '{"city": "Paris",  "unit":"c"}')]
    assert message.tool_calls[0]["id"] == "call_t0000" and message.tool_calls[0]["type"] == "function"
    assert message.finish_reason_override == "tool_calls"


def test_parallel_calls_with_content_before():
    paris, rome = call("get_weather", '{"city": "Paris"}'), call("get_weather", '{"city": "Rome"}')
    text = "Let me check both.\n" + paris + "\n" + rome
    message = qwen(text)
    assert message.content == "Let me check both."
    assert names_and_args(message) == [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Rome"}')]
    assert [c["id"] for c in message.tool_calls] == ["call_t0000", "call_t0001"]


def test_all_json_types_escapes_and_unicode():
    arguments = (
        '{"s": "quote \\" backslash \\\\ newline \\n tab \\t </tool_call> inside", "i": -3, "f": 1.5e3, '
        '"t": true, "n": null, "l": [1, "two", {"x": []}], "o": {"nested": {"k": "v"}}, '
        '"u": "Zürich 東京 🚀", "esc": "\\u00fc"}'
    )
    message = qwen(call("typed", arguments))
    assert names_and_args(message) == [("typed", arguments)]
    decoded = json.loads(message.tool_calls[0]["function"]["arguments"])
    assert decoded["u"] == "Zürich 東京 🚀" and decoded["esc"] == "ü" and decoded["l"][2] == {"x": []}


def test_empty_and_missing_arguments():
    assert names_and_args(qwen(call("now", "{}"))) == [("now", "{}")]
    assert names_and_args(qwen('<tool_call>\n{"name": "now"}\n</tool_call>')) == [("now", "{}")]


def test_double_encoded_arguments_and_parameters_key():
    message = qwen('<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}\n</tool_call>')
    assert names_and_args(message) == [("get_weather", '{"city": "Oslo"}')]
    message = qwen('<tool_call>{"name": "get_weather", "parameters": {"city": "Oslo"}}</tool_call>')
    assert names_and_args(message) == [("get_weather", '{"city": "Oslo"}')]


def test_text_after_calls_is_content_and_whitespace_around_calls_is_markup():
    message = qwen("Intro\n\n" + call("now", "{}") + "\n\nDone.\n")
    assert message.content == "IntroDone.\n"
    assert names_and_args(message) == [("now", "{}")]


@pytest.mark.parametrize(
    "body",
    [
        '{"arguments": {}}',  # no name
        '{"name": 3, "arguments": {}}',
        '{"name": "x", "arguments": [1, 2]}',  # arguments not an object
        "not json at all",
    ],
)
def test_malformed_call_is_content(body):
    text = f"Before\n<tool_call>\n{body}\n</tool_call>\nafter"
    message = qwen(text)
    assert message.tool_calls == [] and message.finish_reason_override is None
    assert message.content == text


@pytest.mark.parametrize(
    "text,expected",
    [
        ('<tool_call>\n{"name": "x", "arguments": {"a": 1}} trailing\n</tool_call>', ("x", '{"a": 1}')),
        ('<tool_call>\n{"name": "x", "arguments": {"a": 1\n</tool_call>', ("x", '{"a": 1\n}')),  # unclosed object
        ('<tool_call>\n{"name": "now", "arguments": {"city": "Par', ("now", '{"city": "Par"}')),  # cut off
    ],
)
def test_a_call_whose_arguments_began_stays_a_call_closed_into_valid_json(text, expected):
    message = qwen("Before " + text)
    assert message.content == "Before" and names_and_args(message) == [expected]
    assert json.loads(expected[1]) and message.finish_reason_override == "tool_calls"


def test_without_streaming_a_call_cut_off_by_max_tokens_is_content():
    """The reported case: a non-streamed response never returns arguments a client's JSON.parse throws on."""
    text = 'Before <tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    message = qwen(text, streaming=False)
    assert message.tool_calls == [] and message.content == text and message.finish_reason_override is None
    whole = qwen(text + '"}}\n</tool_call>', streaming=False)
    assert names_and_args(whole) == [("get_weather", '{"city": "Par"}')] and whole.content == "Before"


def test_arguments_stream_as_they_arrive_without_the_closing_markup():
    parser = get_output_parser("qwen2.5", TOOLS, reasoning=False, id_prefix="s")
    assert parser.feed('<tool_call>\n{"name": "get_weather", "argu') == []  # the arguments have not begun
    assert parser.feed('ments": {"ci') == [
        Delta("call", "get_weather", item=0, call_index=0, call_id="call_s0000"),
        Delta("arguments", '{"ci', item=0, call_index=0),
    ]
    fragment = 'ty": "{P}a\\\\"}'  # braces and an escaped backslash inside a string do not end the arguments
    assert parser.feed(fragment) == [Delta("arguments", fragment, item=0, call_index=0)]
    assert parser.feed('}\n</tool_call>') == [] and parser.finish() == []
    assert parser.result().tool_calls[0]["function"]["arguments"] == '{"city": "{P}a\\\\"}'


def test_every_argument_character_goes_out_when_it_arrives():
    factory = lambda: get_output_parser("qwen2.5", TOOLS, reasoning=False, id_prefix="s")  # noqa: E731
    arguments = '{"city": "A}\\"", "n": {"x": [1]}}'
    assert argument_fragments(factory, call("typed", arguments)) == [list(arguments)]


def test_a_name_after_the_arguments_is_held_back_and_sent_whole():
    factory = lambda: get_output_parser("qwen2.5", TOOLS, reasoning=False, id_prefix="s")  # noqa: E731
    text = '<tool_call>\n{"arguments": {"city": "Oslo"}, "name": "get_weather"}\n</tool_call>'
    assert argument_fragments(factory, text) == [['{"city": "Oslo"}']]
    assert names_and_args(qwen(text)) == [("get_weather", '{"city": "Oslo"}')]


def test_malformed_call_next_to_a_good_one():
    bad = "<tool_call>\n{oops}\n</tool_call>"
    message = qwen(call("now", "{}") + "\n" + bad)
    assert names_and_args(message) == [("now", "{}")]
    assert message.content == bad


@pytest.mark.parametrize(
    "tail",
    ["<tool_call>", "<tool_call>\n", '<tool_call>\n{"name": "get_weather", "argu', "<tool_ca", "<"],
)
def test_truncated_call_falls_back_to_content(tail):
    message = qwen("Text " + tail)
    assert message.tool_calls == []
    assert message.content == "Text " + tail


def test_unclosed_but_complete_call_at_the_end_is_a_call():
    message = qwen('<tool_call>\n{"name": "now", "arguments": {}}\n<|im_end|>')
    assert names_and_args(message) == [("now", "{}")]


def test_missing_close_before_the_next_call():
    message = qwen('<tool_call>\n{"name": "now", "arguments": {}}\n' + call("get_weather", '{"city": "A"}'))
    assert names_and_args(message) == [("now", "{}"), ("get_weather", '{"city": "A"}')]


def test_no_tools_or_tool_choice_none_parses_nothing():
    text = call("now", "{}")
    assert qwen(text, tools=None).content == text
    message = qwen(text, tool_choice="none")
    assert message.content == text and message.tool_calls == []


def test_end_of_turn_tokens_are_stripped_and_end_the_reply():
    assert qwen("Hi<|im_end|>\n<|im_start|>user").content == "Hi"
    assert qwen("Hi<|endoftext|>").content == "Hi"


def test_partial_tag_is_held_back_then_released():
    parser = get_output_parser("qwen2.5", TOOLS, reasoning=False, id_prefix="t")
    assert parser.feed("Hi <tool") == [Delta("text", "Hi", item=0)]  # the space may be markup before a call
    assert parser.feed("box>") == [Delta("text", " <toolbox>", item=0)]
    assert parser.feed("<|im_") == []
    assert parser.finish() == [Delta("text", "<|im_", item=0)]


def test_call_deltas_shape():
    """Neutral deltas from the parser, OpenAI chunk deltas from the chat adapter."""
    from server.api.chat import openai_delta

    deltas, _ = run(lambda: get_output_parser("qwen2.5", TOOLS, reasoning=False, id_prefix="ab"), [call("now", "{}")])
    assert deltas == [Delta("call", "now", item=0, call_index=0, call_id="call_ab0000"),
                      Delta("arguments", "{}", item=0, call_index=0)]
    assert [openai_delta(d) for d in deltas] == [
        {"tool_calls": [{"index": 0, "id": "call_ab0000", "type": "function",
                         "function": {"name": "now", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]},
    ]


def test_generic_jinja_family_uses_the_json_format():
    assert names_and_args(qwen(call("now", "{}"), family="jinja")) == [("now", "{}")]
    assert qwen("plain", family="jinja").content == "plain"


def test_a_literal_tag_in_prose_is_text_and_the_next_call_is_found():
    text = "Write `<tool_call>` then JSON.\n" + call("now", "{}")
    message = qwen(text)
    assert message.content == "Write `<tool_call>` then JSON." and names_and_args(message) == [("now", "{}")]
    # It is content as soon as it cannot be a call: streaming is not held back to the end.
    parser = get_output_parser("qwen2.5", TOOLS, reasoning=False, id_prefix="t")
    assert parser.feed("Write `<tool_call>` then") == [Delta("text", "Write `<tool_call>` then", item=0)]


@pytest.mark.parametrize("fence", ["```", "~~~", "  ```python"])
def test_call_tags_inside_a_code_fence_are_code(fence):
    block = f"Like this:\n{fence}\n{call('now', '{}')}\n{fence.strip()[:3]}\n"
    message = qwen(block + call("get_weather", '{"city": "Rome"}'))
    assert message.content == block.rstrip("\n") and names_and_args(message) == [("get_weather", '{"city": "Rome"}')]


@pytest.mark.parametrize("family", ["qwen2.5", "deepseek-v3", "qwen3-coder"])
@pytest.mark.parametrize("streaming", [False, True])
def test_a_call_cut_off_by_max_tokens_leaves_no_markup_in_content(family, streaming):
    """Every cut point inside a second call: the first (complete) call stays, nothing of the second reaches content
    (not `<tool_call>`, not a partial `<too`), and every call's arguments parse."""
    from server.parsing.registry import family_parsing

    fmt = family_parsing(family).tool_format(TOOLS)
    opening, closing = fmt.call_tag("get_weather")
    first = opening + '{"city": "Paris"}' + closing if fmt.argument_style == "json" else None
    if first is None:  # Qwen3-Coder's XML arguments
        first = opening + "<parameter=city>\nParis\n</parameter>\n" + closing
    blocks = (fmt.block_open or "", fmt.block_close or "")
    second = fmt.call_separator + (opening + '{"city": "Rome", "unit": "c"}' + closing
                                   if fmt.argument_style == "json" else opening + "<parameter=city>\nRome\n")
    for cut in range(len(second)):
        text = blocks[0] + first + second[:cut]
        parser = get_output_parser(family, TOOLS, reasoning=False, id_prefix="t", streaming=streaming)
        deltas = parser.feed(text) + parser.finish(cut=True)
        message = parser.result()
        assert not message.content, (cut, message.content)
        assert all(d.kind != "text" for d in deltas)
        assert 1 <= len(message.tool_calls) <= 2  # the second stays once its arguments are whole (or streaming)
        assert message.tool_calls[0]["function"]["name"] == "get_weather"
        assert all(json.loads(c["function"]["arguments"]) is not None for c in message.tool_calls)
    # Without a cut (the model itself stopped there), an unfinished call is content, as before.
    parser = get_output_parser(family, TOOLS, reasoning=False, id_prefix="t", streaming=False)
    parser.feed(blocks[0] + first + fmt.call_separator + opening[:-1])
    parser.finish()
    assert parser.result().content
