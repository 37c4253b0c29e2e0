"""GLM-4.7's output: `<think>` reasoning (the prompt opened it), `<tool_call>NAME<arg_key>K</arg_key><arg_value>V
</arg_value></tool_call>` calls with values typed by the tools' schemas, the next turn's role token as the end of the
reply; the same message under every split of the text, and deltas that rebuild it."""
import json

import pytest

from server.parsing import get_output_parser
from server.parsing.formats.glm_xml import GlmFormat

from tests.parsing.fixtures import TOOLS
from tests.parsing.streaming import argument_fragments, parse_checked


def glm(text: str, reasoning: bool = False, tools=TOOLS, **kwargs):
    factory = lambda: get_output_parser("glm-4.7", tools, reasoning=reasoning, id_prefix="g", **kwargs)  # noqa: E731
    return parse_checked(factory, text)


def glm_call(name: str, args: dict[str, str]) -> str:
    return f"<tool_call>{name}" + "".join(f"<arg_key>{k}</arg_key><arg_value>{v}</arg_value>"
                                          for k, v in args.items()) + "</tool_call>"


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.tool_calls]


def test_reasoning_content_and_parallel_calls():
    text = ("Two cities.</think>Checking both." + glm_call("get_weather", {"city": "Paris"})
            + glm_call("get_weather", {"city": "東京", "unit": "c"}) + "<|observation|>")
    message = glm(text, reasoning=True)
    assert message.reasoning_content == "Two cities."
    assert message.content == "Checking both."
    assert calls_of(message) == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "東京", "unit": "c"})]
    assert message.tool_calls[1]["function"]["arguments"] == '{"city": "東京", "unit": "c"}'


def test_values_typed_by_the_schema():
    args = {"count": "42", "ratio": "0.25", "flag": "true", "options": '{"a": [1, 2], "b": null}', "items": '["x"]',
            "nothing": "null", "text": "42", "maybe": "null", "either": "true", "undeclared": "7"}
    [(name, parsed)] = calls_of(glm(glm_call("typed", args)))
    assert name == "typed"
    assert parsed == {"count": 42, "ratio": 0.25, "flag": True, "options": {"a": [1, 2], "b": None}, "items": ["x"],
                      "nothing": None, "text": "42", "maybe": None, "either": True, "undeclared": "7"}


def test_raw_string_values_keep_markup_newlines_and_call_tags():
    code = 'if a < b:\n    print("</tool_call> <arg_key>")\n'
    [(_, parsed)] = calls_of(glm(glm_call("get_weather", {"city": code})))
    assert parsed == {"city": code}


def test_a_call_without_arguments_and_layout_whitespace():
    message = glm("<tool_call>now</tool_call>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
                  "<arg_value>Oslo</arg_value>\n</tool_call>")
    assert calls_of(message) == [("now", {}), ("get_weather", {"city": "Oslo"})]
    assert message.content is None


def test_the_reply_ends_at_the_next_turns_role_token():
    message = glm("It is 18C.<|user|>Thanks!<|assistant|>", reasoning=False)
    assert message.content == "It is 18C." and message.tool_calls == []


def test_tool_call_in_prose_is_content():
    message = glm("Use the <tool_call> tag like this: <tool_call>name with spaces</tool_call> ok")
    assert message.tool_calls == []
    assert message.content == "Use the <tool_call> tag like this: <tool_call>name with spaces</tool_call> ok"


def test_arguments_stream_per_completed_pair():
    factory = lambda: get_output_parser("glm-4.7", TOOLS, reasoning=False, id_prefix="g")  # noqa: E731
    text = glm_call("get_weather", {"city": "Paris", "unit": "c"})
    assert argument_fragments(factory, text) == [['{"city": "Paris"', ', "unit": "c"', "}"]]


def test_broken_markup_ends_the_arguments_and_a_repeated_key_keeps_its_first_value():
    text = ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Rome</arg_value><arg_key>city</arg_key>"
            "<arg_value>Nice</arg_value>oops<arg_key>unit</arg_key><arg_value>f</arg_value></tool_call>")
    assert calls_of(glm(text)) == [("get_weather", {"city": "Rome"})]


@pytest.mark.parametrize("cut", ["<tool_call>get_weather<arg_key>city</arg_key><arg_value>Par",
                                 "<tool_call>get_weather<arg_key>ci"])
def test_a_call_cut_off_by_the_token_limit_is_valid_json(cut):
    parser = get_output_parser("glm-4.7", TOOLS, reasoning=False, id_prefix="g")
    parser.feed(cut)
    parser.finish(cut=True)
    assert [json.loads(c["function"]["arguments"]) for c in parser.result().tool_calls] in ([], [{}])


def test_call_tags_are_the_templates():
    assert GlmFormat(TOOLS).call_tag("get_weather") == ("<tool_call>get_weather", "</tool_call>")
