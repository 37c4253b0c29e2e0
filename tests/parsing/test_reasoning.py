import pytest

from server.parsing import Delta, get_output_parser

from tests.parsing.fixtures import TOOLS
from tests.parsing.streaming import parse_checked


def parse(family: str, text: str, reasoning: bool = True, tools=None):
    factory = lambda: get_output_parser(family, tools, reasoning=reasoning, id_prefix="r")  # noqa: E731
    return parse_checked(factory, text)


def test_qwen3_thinking_then_answer():
    message = parse("qwen3", "<think>\nLet me think.\nStep 2.\n</think>\n\nThe answer is 4.<|im_end|>")
    assert message.reasoning_content == "Let me think.\nStep 2."
    assert message.content == "The answer is 4."


def test_qwen3_empty_think_block_is_no_reasoning():
    message = parse("qwen3", "<think>\n\n</think>\n\nHi")
    assert message.reasoning_content is None and message.content == "Hi"


def test_qwen3_without_think_is_all_content():
    message = parse("qwen3", "Just an answer with </think> and <think> in it.")
    assert message.reasoning_content is None
    assert message.content == "Just an answer with </think> and <think> in it."


def test_qwen3_thinking_off_keeps_tags_as_text():
    message = parse("qwen3", "<think>\nx\n</think>\n\ny", reasoning=False)
    assert message.reasoning_content is None and message.content == "<think>\nx\n</think>\n\ny"


def test_qwen3_tags_after_the_answer_starts_are_text():
    message = parse("qwen3", "<think>a</think>b<think>c</think>")
    assert message.reasoning_content == "a" and message.content == "b<think>c</think>"


def test_qwen3_truncated_reasoning_stays_reasoning():
    message = parse("qwen3", "<think>\nStill thinking about <tool_call> and\n")
    assert message.reasoning_content == "Still thinking about <tool_call> and" and message.content == ""


def test_tool_calls_inside_reasoning_are_not_calls():
    text = '<think>\nMaybe <tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>\n</think>\n\nNo call.'
    message = parse("qwen3", text, tools=TOOLS)
    assert message.tool_calls == [] and message.content == "No call."
    assert message.reasoning_content.startswith("Maybe <tool_call>")


@pytest.mark.parametrize("family", ["deepseek-r1", "deepseek-r1-distill", "deepseek-r1-0528"])
def test_r1_output_starts_inside_reasoning(family):
    message = parse(family, "Okay, so 2+2.\n</think>\n\n**4**<｜end▁of▁sentence｜>", reasoning=False)
    assert message.reasoning_content == "Okay, so 2+2." and message.content == "**4**"


@pytest.mark.parametrize("family", ["deepseek-r1", "deepseek-r1-0528"])
def test_r1_model_written_think_opening_is_accepted(family):
    message = parse(family, "<think>\nHmm.\n</think>\n\nDone.")
    assert message.reasoning_content == "Hmm." and message.content == "Done."


def test_r1_truncated_is_all_reasoning():
    message = parse("deepseek-r1", "I am still")
    assert message.reasoning_content == "I am still" and message.content == ""


def test_v31_thinking_on_and_off():
    on = parse("deepseek-v3.1", "Reason here.</think>Answer.<｜end▁of▁sentence｜>", reasoning=True)
    assert on.reasoning_content == "Reason here." and on.content == "Answer."
    off = parse("deepseek-v3.1", "Answer with </think> inside.", reasoning=False)
    assert off.reasoning_content is None and off.content == "Answer with </think> inside."


def test_reasoning_deltas_arrive_before_the_answer_is_known():
    parser = get_output_parser("qwen3", None, reasoning=True, id_prefix="r")
    assert parser.feed("<think>\nab") == [Delta("reasoning", "ab", item=0)]
    assert parser.feed("c\n</th") == [Delta("reasoning", "c", item=0)]  # trailing newline held until we know
    assert parser.feed("ink>\n\nHi") == [Delta("text", "Hi", item=1)]
    assert parser.finish() == []


def test_whitespace_only_output_inside_reasoning_is_empty():
    message = parse("deepseek-r1", "\n", reasoning=False)
    assert message.reasoning_content is None and message.content == ""
