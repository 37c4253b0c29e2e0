"""Gemma 4's calls: `<|tool_call>call:NAME{key:value,...}<tool_call|>` in Gemma's notation (`<|"|>`-quoted strings,
bare numbers typed by the tools' schemas, nested objects and lists), the turn ending with `<turn|>`; the same message
under every split of the text, deltas that rebuild it, and the calls the renderer writes read back as they were."""
import json

import pytest

from server.parsing import get_output_parser
from server.rendering.native.gemma4 import call_text

from tests.parsing.fixtures import TOOLS
from tests.parsing.streaming import argument_fragments, parse_checked

Q = '<|"|>'


def gemma4(text: str, tools=TOOLS, **kwargs):
    factory = lambda: get_output_parser("gemma4", tools, reasoning=False, id_prefix="g", **kwargs)  # noqa: E731
    return parse_checked(factory, text)


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.tool_calls]


def test_text_then_parallel_calls_then_end_of_turn():
    text = (f"Checking both.<|tool_call>call:get_weather{{city:{Q}Paris{Q}}}<tool_call|>"
            f"<|tool_call>call:get_weather{{city:{Q}東京{Q},unit:{Q}c{Q}}}<tool_call|><turn|>")
    message = gemma4(text)
    assert message.content == "Checking both."
    assert calls_of(message) == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "東京", "unit": "c"})]
    assert message.tool_calls[1]["function"]["arguments"] == '{"city": "東京", "unit": "c"}'


def test_bare_values_typed_by_the_schema_and_nested_values_read_in_the_notation():
    body = (f"count:42,either:true,flag:false,items:[1,{Q}x{Q},None],maybe:None,nothing:None,"
            f"options:{{a:[1,2.5],b:{{c:{Q}d{Q}}}}},ratio:0.25,text:42,undeclared:7")
    [(name, parsed)] = calls_of(gemma4(f"<|tool_call>call:typed{{{body}}}<tool_call|>"))
    assert name == "typed"
    assert parsed == {"count": 42, "either": True, "flag": False, "items": [1, "x", None], "maybe": None,
                      "nothing": None, "options": {"a": [1, 2.5], "b": {"c": "d"}}, "ratio": 0.25, "text": "42",
                      "undeclared": 7}


def test_strings_keep_markup_braces_commas_and_the_closing_tag():
    code = 'if a < b: print("}<tool_call|>, {x:1}")\n<|tool_call>'
    [(_, parsed)] = calls_of(gemma4(f"<|tool_call>call:get_weather{{city:{Q}{code}{Q}}}<tool_call|>"))
    assert parsed == {"city": code}


@pytest.mark.parametrize("arguments", [
    {"city": "Paris", "unit": "f"},
    {"count": 3, "ratio": -1.5, "flag": True, "items": ["a", {"k": "v"}], "options": {"Z": 1, "a": [True, None]},
     "text": "3 < 4, {ok}"},
    {},
])
def test_the_renderers_calls_read_back_as_they_were(arguments):
    name = "typed" if "count" in arguments else "get_weather" if arguments else "now"
    message = gemma4(call_text({"name": name, "arguments": arguments}) + "<turn|>")
    assert calls_of(message) == [(name, arguments)]


def test_arguments_stream_pair_by_pair():
    text = f"<|tool_call>call:get_weather{{city:{Q}Oslo{Q},unit:{Q}c{Q}}}<tool_call|>"
    factory = lambda: get_output_parser("gemma4", TOOLS, reasoning=False, id_prefix="g")  # noqa: E731
    assert argument_fragments(factory, text) == [['{"city": "Oslo"', ', "unit": "c"', "}"]]


def test_what_is_not_a_call_stays_content():
    for text in ("Use <|tool_call> like this.", "<|tool_call>cal x{}<tool_call|>", "a <|tool_call>call:bad name{"):
        message = gemma4(text)
        assert message.tool_calls == [] and message.content == text, text


def test_a_call_cut_off_by_the_token_limit_has_valid_arguments():
    parser = get_output_parser("gemma4", TOOLS, reasoning=False, id_prefix="g")
    parser.feed(f"<|tool_call>call:get_weather{{city:{Q}Oslo{Q},unit:{Q}c")
    parser.finish(cut=True)
    [(name, parsed)] = calls_of(parser.result())
    assert (name, parsed) == ("get_weather", {"city": "Oslo"})


def test_thinking_in_its_channel_then_a_call():
    text = (f"<|channel>thought\nThe user wants Paris.\n<channel|>Checking."
            f"<|tool_call>call:get_weather{{city:{Q}Paris{Q}}}<tool_call|><turn|>")
    factory = lambda: get_output_parser("gemma4", TOOLS, reasoning=True, id_prefix="g")  # noqa: E731
    message = parse_checked(factory, text)
    assert message.reasoning_content == "The user wants Paris."
    assert message.content == "Checking."
    assert calls_of(message) == [("get_weather", {"city": "Paris"})]
    # Thinking off: the prompt closed an empty thought, so what comes is the answer
    assert gemma4("It is 18C.<turn|>").content == "It is 18C."
