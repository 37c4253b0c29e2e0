import json

import pytest

from server.parsing import Delta, get_output_parser
from server.parsing.param_types import coerce_parameter, schema_types

from tests.parsing.fixtures import TOOLS
from tests.parsing.streaming import argument_fragments, parse_checked


def coder(text: str, tools=TOOLS, **kwargs):
    factory = lambda: get_output_parser("qwen3-coder", tools, reasoning=False, id_prefix="c", **kwargs)  # noqa: E731
    return parse_checked(factory, text)


def xml_call(name: str, params: dict[str, str]) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def args_of(message) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.tool_calls]


def test_plain_text():
    message = coder("Nothing to call.\n<|im_end|>")
    assert message.content == "Nothing to call.\n" and message.tool_calls == []


def test_one_call_with_content_before():
    message = coder("Let me check the weather.\n\n" + xml_call("get_weather", {"city": "Paris", "unit": "c"}))
    assert message.content == "Let me check the weather."
    assert args_of(message) == [("get_weather", {"city": "Paris", "unit": "c"})]
    # arguments are serialised like the template's tojson, in the model's order
    assert message.tool_calls[0]["function"]["arguments"] == '{"city": "Paris", "unit": "c"}'


def test_parallel_calls():
    text = xml_call("get_weather", {"city": "Paris"}) + "\n" + xml_call("get_weather", {"city": "東京"})
    assert args_of(coder(text)) == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "東京"})]


def test_values_typed_by_schema():
    params = {
        "count": "42",
        "ratio": "0.25",
        "flag": "True",
        "options": '{"a": [1, 2], "b": null}',
        "items": "['x', 'y']",  # Python repr, as the July template rendered history
        "nothing": "null",
        "text": "123",  # a string parameter stays a string
        "maybe": "null",
        "either": "false",
    }
    ((name, arguments),) = args_of(coder(xml_call("typed", params)))
    assert name == "typed"
    assert arguments == {
        "count": 42,
        "ratio": 0.25,
        "flag": True,
        "options": {"a": [1, 2], "b": None},
        "items": ["x", "y"],
        "nothing": None,
        "text": "123",
        "maybe": None,
        "either": False,
    }


def test_values_that_do_not_fit_their_type_stay_strings():
    params = {"count": "about 3", "flag": "yes", "options": "{not json", "unknown": "7"}
    ((_, arguments),) = args_of(coder(xml_call("typed", params)))
    assert arguments == {"count": "about 3", "flag": "yes", "options": "{not json", "unknown": "7"}


def test_multiline_value_and_tags_inside_values():
    code = 'def f():\n    return "<tool_call>"  # </tool_call>\n\nprint(f())'
    ((_, arguments),) = args_of(coder(xml_call("get_weather", {"city": code})))
    assert arguments == {"city": code}


def test_exactly_one_newline_is_stripped_around_values():
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\n\nA\n\n</parameter>\n</function>\n</tool_call>"
    assert args_of(coder(text)) == [("get_weather", {"city": "\nA\n"})]


def test_no_parameters():
    message = coder("<tool_call>\n<function=now>\n</function>\n</tool_call>")
    assert args_of(message) == [("now", {})]
    assert message.tool_calls[0]["function"]["arguments"] == "{}"


def test_missing_parameter_close_before_the_next_parameter():
    text = (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
        "<parameter=unit>\nc\n</parameter>\n</function>\n</tool_call>"
    )
    assert args_of(coder(text)) == [("get_weather", {"city": "Paris", "unit": "c"})]


def test_unknown_function_is_still_a_call_with_string_values():
    assert args_of(coder(xml_call("other", {"n": "5"}))) == [("other", {"n": "5"})]


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>\n<function=get_wea",  # truncated before the name is known
        "<tool_call>\nget_weather(city='Paris')\n</tool_call>",  # not the format
        "<tool_call>\n<function=>\n</function>\n</tool_call>",
        "<tool_call>\n<function=get\nweather>\n</function>\n</tool_call>",
    ],
)
def test_malformed_or_truncated_falls_back_to_content(text):
    message = coder("Hi\n" + text)
    assert message.tool_calls == [] and message.finish_reason_override is None
    assert message.content == "Hi\n" + text


@pytest.mark.parametrize(
    "text,expected",
    [
        ("<function=get_weather>\n<parameter=city>\nPar", {}),  # cut off inside a value: the value is dropped
        ("<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n", {"city": "Paris"}),  # no </function>
        ("<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_ca", {"city": "Paris"}),
        ("<function=get_weather>\n<parameter=city>\nA\n</parameter>\nstray\n<parameter=unit>\nc\n</parameter>\n"
         "</function>\n</tool_call>", {"city": "A"}),  # text that breaks the format ends the parameters
        ("<function=get_weather>\n<parameter=city>\nA\n</parameter>\n<parameter=city>\nB\n</parameter>\n"
         "</function>\n</tool_call>", {"city": "A"}),  # a repeated parameter keeps its first value
    ],
)
def test_a_call_whose_function_tag_parsed_stays_a_call(text, expected):
    message = coder("Hi\n<tool_call>\n" + text)
    assert message.content == "Hi" and args_of(message) == [("get_weather", expected)]


def test_arguments_stream_one_completed_parameter_at_a_time():
    factory = lambda: get_output_parser("qwen3-coder", TOOLS, reasoning=False, id_prefix="c")  # noqa: E731
    text = xml_call("typed", {"count": "7", "text": "a </parameter"}) + "\n" + xml_call("now", {})
    assert argument_fragments(factory, text) == [['{"count": 7', ', "text": "a </parameter"', "}"], ["{}"]]
    parser = factory()
    assert parser.feed("<tool_call>\n<function=typed>\n<parameter=count>\n7\n</param") == [
        Delta("call", "typed", item=0, call_index=0, call_id="call_c0000"),
    ]
    assert parser.feed("eter>\n") == [Delta("arguments", '{"count": 7', item=0, call_index=0)]


def test_schema_types_and_coercion_helpers():
    assert schema_types({"type": ["integer", "null"]}) == ["integer", "null"]
    assert schema_types({"anyOf": [{"type": "int"}, {"type": "str"}]}) == ["integer", "string"]
    assert schema_types(None) == [] and schema_types({"enum": ["a"]}) == []
    assert coerce_parameter("3.0", {"type": "integer"}) == 3
    assert coerce_parameter("3.5", {"type": "integer"}) == "3.5"
    assert coerce_parameter("1e3", {"type": "number"}) == 1000.0
    assert coerce_parameter("true", {"type": "number"}) == "true"
    assert coerce_parameter("NaN", {"type": "number"}) == "NaN"
    assert coerce_parameter("[1]", {"type": "object"}) == "[1]"
    assert coerce_parameter("null", {"type": "string"}) == "null"
    assert coerce_parameter("7", {"type": ["string", "integer"]}) == 7
