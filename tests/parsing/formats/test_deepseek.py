import json

import pytest

from server.parsing import get_output_parser
from server.parsing.formats.deepseek import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, SEP

from tests.parsing.fixtures import TOOLS
from tests.parsing.streaming import argument_fragments, parse_checked

EOS = "<｜end▁of▁sentence｜>"
V3_FAMILIES = ["deepseek-v3", "deepseek-v3-0324", "deepseek-r1-0528"]


def parse(family: str, text: str, *, reasoning: bool = False, **kwargs):
    factory = lambda: get_output_parser(family, TOOLS, reasoning=reasoning, id_prefix="d", **kwargs)  # noqa: E731
    return parse_checked(factory, text)


def v3_call(name: str, arguments: str) -> str:
    return f"{CALL_BEGIN}function{SEP}{name}\n```json\n{arguments}\n```{CALL_END}"


def v3_calls(*calls: str) -> str:
    return CALLS_BEGIN + "\n".join(calls) + CALLS_END


def v31_calls(*calls: tuple[str, str]) -> str:
    return CALLS_BEGIN + "".join(f"{CALL_BEGIN}{n}{SEP}{a}{CALL_END}" for n, a in calls) + CALLS_END


def calls_of(message) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in message.tool_calls]


@pytest.mark.parametrize("family", ["deepseek-v3", "deepseek-v3-0324", "deepseek-v3.1"])
def test_plain_text(family):
    message = parse(family, "Hello ｜ world ▁" + EOS)
    assert message.content == "Hello ｜ world ▁" and message.tool_calls == []


@pytest.mark.parametrize("family", ["deepseek-v3", "deepseek-v3-0324"])
def test_v3_one_call_keeps_arguments_verbatim(family):
    arguments = '{"city":  "Zürich", "unit": "c"}'
    message = parse(family, v3_calls(v3_call("get_weather", arguments)) + EOS)
    assert message.content is None and calls_of(message) == [("get_weather", arguments)]
    assert message.finish_reason_override == "tool_calls"


@pytest.mark.parametrize("family", ["deepseek-v3", "deepseek-v3-0324"])
def test_v3_parallel_calls_with_content_before(family):
    text = "Checking both.\n\n" + v3_calls(v3_call("get_weather", '{"city": "A"}'), v3_call("now", "{}")) + EOS
    message = parse(family, text)
    # DeepSeek templates concatenate content and calls, so the content keeps its whitespace
    assert message.content == "Checking both.\n\n"
    assert calls_of(message) == [("get_weather", '{"city": "A"}'), ("now", "{}")]


def test_v3_all_json_types_and_escapes():
    arguments = '{"s": "a \\"q\\" \\\\ \\n ```", "n": null, "b": false, "i": 1, "f": -2.5, "l": [], "o": {"k": [{}]}}'
    message = parse("deepseek-v3", v3_calls(v3_call("typed", arguments)))
    assert calls_of(message) == [("typed", arguments)]
    assert json.loads(message.tool_calls[0]["function"]["arguments"])["s"] == 'a "q" \\ \n ```'


def test_v3_unfenced_or_loosely_fenced_arguments_are_accepted():
    loose = f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}now\n```json\n{{}}```{CALL_END}{CALLS_END}"
    bare = f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}now\n{{\"a\": 1}}{CALL_END}{CALLS_END}"
    assert calls_of(parse("deepseek-v3", loose)) == [("now", "{}")]
    assert calls_of(parse("deepseek-v3", bare)) == [("now", '{"a": 1}')]


def test_v31_calls_chained_without_separator():
    text = "Sure." + v31_calls(("get_weather", '{"city": "Paris"}'), ("now", "{}")) + EOS
    message = parse("deepseek-v3.1", text)
    assert message.content == "Sure."
    assert calls_of(message) == [("get_weather", '{"city": "Paris"}'), ("now", "{}")]


def test_v31_thinking_then_call():
    text = "I should call it.</think>" + v31_calls(("now", "{}")) + EOS
    message = parse("deepseek-v3.1", text, reasoning=True)
    assert message.reasoning_content == "I should call it."
    assert message.content is None and calls_of(message) == [("now", "{}")]


def test_r1_0528_reasoning_then_calls():
    text = "<think>\nNeed the weather.\n</think>\n\n" + v3_calls(v3_call("get_weather", '{"city": "B"}')) + EOS
    message = parse("deepseek-r1-0528", text, reasoning=True)
    assert message.reasoning_content == "Need the weather."
    assert calls_of(message) == [("get_weather", '{"city": "B"}')]


@pytest.mark.parametrize(
    "family,text",
    [
        ("deepseek-v3", f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}now\n```json\n"),  # truncated before the arguments
        ("deepseek-v3", f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}now\n```json\n[]\n```{CALL_END}{CALLS_END}"),
        ("deepseek-v3", f"{CALLS_BEGIN}{CALL_BEGIN}function now {{}}{CALL_END}{CALLS_END}"),  # no separator
        ("deepseek-v3", f"{CALLS_BEGIN}{CALLS_END}"),
        ("deepseek-v3", CALLS_BEGIN),
        ("deepseek-v3.1", f"{CALLS_BEGIN}{CALL_BEGIN}now{SEP}[1]{CALL_END}{CALLS_END}"),
        ("deepseek-v3.1", f"{CALLS_BEGIN}{CALL_BEGIN}{SEP}{{}}{CALL_END}{CALLS_END}"),  # no name
        ("deepseek-v3.1", f"{CALLS_BEGIN}{CALL_BEGIN}now{SEP}"),
    ],
)
def test_malformed_or_truncated_falls_back_to_content(family, text):
    message = parse(family, "Hi " + text)
    assert message.tool_calls == [] and message.finish_reason_override is None
    assert message.content == "Hi " + text


def test_good_call_then_call_cut_off_before_its_arguments_keeps_the_good_one():
    text = CALLS_BEGIN + v3_call("now", "{}") + "\n" + CALL_BEGIN + "function" + SEP + "get_weather\n```js"
    message = parse("deepseek-v3", text)
    assert calls_of(message) == [("now", "{}")]
    assert message.content == "\n" + CALL_BEGIN + "function" + SEP + "get_weather\n```js"


@pytest.mark.parametrize(
    "family,text,expected",
    [
        ("deepseek-v3", f"{CALL_BEGIN}function{SEP}now\n```json\n{{\"a\": ", ("now", '{"a": null}')),  # cut off
        ("deepseek-v3", f"{CALL_BEGIN}function{SEP}now\n```json\n{{oops}}\n```{CALL_END}", ("now", "{oops}")),
        ("deepseek-v3.1", f"{CALL_BEGIN}now{SEP}{{\"a\": 1}} junk{CALL_END}", ("now", '{"a": 1}')),
        ("deepseek-v3.1", f"{CALL_BEGIN}now{SEP}{{", ("now", "{}")),
    ],
)
def test_a_call_whose_arguments_began_stays_a_call_with_the_streamed_text(family, text, expected):
    """Streamed arguments cannot be taken back: a cut-off object is closed; a balanced but invalid one stays."""
    message = parse(family, "Hi " + CALLS_BEGIN + text)
    assert message.content == "Hi " and calls_of(message) == [expected]
    unstreamed = parse(family, "Hi " + CALLS_BEGIN + text, streaming=False)  # only whole, valid calls are calls
    valid = expected[1] != "{oops}" and text.endswith(CALL_END)
    assert calls_of(unstreamed) == ([expected] if valid else [])
    assert unstreamed.content == ("Hi " if valid else "Hi " + CALLS_BEGIN + text)


@pytest.mark.parametrize("family", ["deepseek-v3", "deepseek-v3.1"])
def test_arguments_stream_character_by_character_without_the_fence(family):
    arguments = '{"s": "```}\\"", "o": {"k": []}}'
    text = v3_calls(v3_call("typed", arguments)) if family == "deepseek-v3" else v31_calls(("typed", arguments))
    factory = lambda: get_output_parser(family, TOOLS, reasoning=False, id_prefix="d")  # noqa: E731
    assert argument_fragments(factory, text + EOS) == [list(arguments)]


def test_missing_calls_end_after_complete_calls():
    message = parse("deepseek-v3.1", CALLS_BEGIN + f"{CALL_BEGIN}now{SEP}{{}}{CALL_END}" + EOS)
    assert calls_of(message) == [("now", "{}")] and message.content is None


def test_text_after_the_block_is_content():
    message = parse("deepseek-v3-0324", v3_calls(v3_call("now", "{}")) + "Done.")
    assert calls_of(message) == [("now", "{}")] and message.content == "Done."


def test_stray_text_inside_a_block_is_content_and_the_calls_still_count():
    text = CALLS_BEGIN + "x \n" + v3_call("now", "{}") + "\n y\n" + v3_call("get_weather", '{"city": "C"}') + CALLS_END
    message = parse("deepseek-v3", text)
    assert calls_of(message) == [("now", "{}"), ("get_weather", '{"city": "C"}')]
    assert message.content == CALLS_BEGIN + "x\n y"
