"""Agent-turn prefix stability, per family (reference NOTES.md §3).

For each scenario: render prompt N (with the generation prompt), append the raw text the model would emit (its own
tool-call / thinking syntax, ending with the EOS string), build the assistant message a parser would return for it,
add the next message (a tool result or a user turn) and render prompt N+1. Prefix caching of the whole previous turn
works only if ``prompt N + output`` is a byte prefix of prompt N+1. Where the official template itself breaks this,
the test asserts the break and *where* it happens (the old text at the first differing byte), so each family's
behaviour is documented and any change to it is noticed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pytest

from server.rendering import get_renderer

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
QUESTION = {"role": "user", "content": "Weather in Paris?"}
FOLLOW_UP = {"role": "user", "content": "Thanks! And Rome?"}
TOOL_RESULT = {"role": "tool", "tool_call_id": "call_0", "content": "18C, cloudy"}
ARGS = '{"city": "Paris"}'
REASONING = "The user wants the weather."
ANSWER = "It is 18 °C in Paris."

QWEN_EOS, DS_EOS = "<|im_end|>", "<｜end▁of▁sentence｜>"
DS_FENCED_CALL = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n" + ARGS
                  + "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>" + DS_EOS)
DS_V31_CALL = f"<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{ARGS}<｜tool▁call▁end｜><｜tool▁calls▁end｜>{DS_EOS}"


def parsed(content: str, reasoning: str | None = None, arguments: str | dict | None = None) -> dict:
    """The assistant message a parser returns (and an OpenAI client echoes back)."""
    message: dict = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if arguments is not None:
        message["tool_calls"] = [{"id": "call_0", "type": "function",
                                  "function": {"name": "get_weather", "arguments": arguments}}]
    return message


@dataclass(frozen=True)
class Output:
    raw: str  # exactly what the model generates after prompt N, EOS included
    message: dict  # what the server returns for it


def qwen_think(reasoning: str | None) -> str:
    return f"<think>\n{reasoning}\n</think>\n\n" if reasoning is not None else ""


def qwen_answer(reasoning: str | None = None) -> Output:
    return Output(qwen_think(reasoning) + ANSWER + QWEN_EOS, parsed(ANSWER, reasoning))


def qwen_call(reasoning: str | None = None, args_text: str = ARGS) -> Output:
    raw = f'{qwen_think(reasoning)}<tool_call>\n{{"name": "get_weather", "arguments": {args_text}}}\n</tool_call>{QWEN_EOS}'
    return Output(raw, parsed("", reasoning, args_text))


CODER_CALL = Output(
    f"<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>{QWEN_EOS}",
    parsed("", arguments={"city": "Paris"}),  # the XML parser types values by the schema
)
# Qwen3.6's generation prompt opens `<think>\n`: the model writes the rest of the block itself.
Q36_ANSWER = Output(f"{REASONING}\n</think>\n\n{ANSWER}{QWEN_EOS}", parsed(ANSWER, REASONING))
Q36_CALL = Output(f"{REASONING}\n</think>\n\n{CODER_CALL.raw}", parsed("", REASONING, {"city": "Paris"}))
R1_ANSWER = Output(f"{REASONING}\n</think>\n\n{ANSWER}{DS_EOS}", parsed(ANSWER, REASONING))  # after a forced `<think>\n`
R1_CALL = Output(f"{REASONING}\n</think>\n\n{DS_FENCED_CALL}", parsed("", REASONING, ARGS))
R1_0528_ANSWER = Output(f"<think>\n{REASONING}\n</think>\n\n{ANSWER}{DS_EOS}", parsed(ANSWER, REASONING))
R1_0528_CALL = Output(f"<think>\n{REASONING}\n</think>\n\n{DS_FENCED_CALL}", parsed("", REASONING, ARGS))
DS_ANSWER = Output(ANSWER + DS_EOS, parsed(ANSWER))


@dataclass(frozen=True)
class Mode:
    family: str
    kwargs: dict
    answer: Output  # a plain answer, in chat and after a tool result
    call: Output | None  # one tool call (None: the family/mode has no tool calling)


MODES = {
    "qwen2.5": Mode("qwen2.5", {}, qwen_answer(), qwen_call()),
    "qwen3-thinking": Mode("qwen3", {}, qwen_answer(REASONING), qwen_call(REASONING)),
    "qwen3-no-thinking": Mode("qwen3", {"enable_thinking": False}, qwen_answer(), qwen_call()),
    "qwen3-coder": Mode("qwen3-coder", {}, qwen_answer(), CODER_CALL),
    # preserve_thinking is kvserve's serving default for Qwen3.6 (docs/SERVER.md); without it the template drops
    # the reasoning of every turn before the last user query.
    "qwen3.6": Mode("qwen3.6", {"preserve_thinking": True}, Q36_ANSWER, Q36_CALL),
    "qwen3.6-no-preserve": Mode("qwen3.6", {}, Q36_ANSWER, Q36_CALL),
    "qwen3.6-no-thinking": Mode("qwen3.6", {"enable_thinking": False, "preserve_thinking": True}, qwen_answer(),
                                CODER_CALL),
    "deepseek-v3": Mode("deepseek-v3", {}, DS_ANSWER, Output(DS_FENCED_CALL, parsed("", arguments=ARGS))),
    "deepseek-v3-0324": Mode("deepseek-v3-0324", {}, DS_ANSWER, Output(DS_FENCED_CALL, parsed("", arguments=ARGS))),
    "deepseek-v3.1": Mode("deepseek-v3.1", {"thinking": False}, DS_ANSWER, Output(DS_V31_CALL, parsed("", arguments=ARGS))),
    # Thinking mode: `<think>` is in the prompt; tool calling is officially supported only without thinking.
    "deepseek-v3.1-thinking": Mode("deepseek-v3.1", {"thinking": True},
                                   Output(f"{REASONING}</think>{ANSWER}{DS_EOS}", parsed(ANSWER, REASONING)), None),
    "deepseek-r1": Mode("deepseek-r1", {}, R1_ANSWER, R1_CALL),
    "deepseek-r1-0528": Mode("deepseek-r1-0528", {}, R1_0528_ANSWER, R1_0528_CALL),
    "deepseek-r1-distill": Mode("deepseek-r1-distill", {}, R1_ANSWER, R1_CALL),
}


def chat_turn(mode: Mode) -> tuple[list[dict], Output, dict]:
    return [QUESTION], mode.answer, FOLLOW_UP


def tool_step(mode: Mode) -> tuple[list[dict], Output, dict]:
    return [QUESTION], mode.call, TOOL_RESULT


def answer_after_tool(mode: Mode) -> tuple[list[dict], Output, dict]:
    return [QUESTION, mode.call.message, TOOL_RESULT], mode.answer, FOLLOW_UP


SCENARIOS: dict[str, Callable[[Mode], tuple[list[dict], Output, dict]]] = {
    "chat_turn": chat_turn, "tool_step": tool_step, "answer_after_tool": answer_after_tool,
}

# None: prompt N + output is a prefix of prompt N+1. Otherwise the text of (prompt N + output) at the first
# differing byte, i.e. what the template does not reproduce. Cause in the comment.
EXPECTED: dict[tuple[str, str], str | None] = {
    ("qwen2.5", "chat_turn"): None,
    ("qwen2.5", "tool_step"): None,  # arguments re-serialized by tojson: identical when the model used ", "/": "
    ("qwen2.5", "answer_after_tool"): None,
    ("qwen3-thinking", "chat_turn"): "<think>",  # reasoning before the last user query is dropped
    ("qwen3-thinking", "tool_step"): None,  # inside a tool loop the echoed reasoning_content is kept
    ("qwen3-thinking", "answer_after_tool"): "<think>",  # a new user query drops the whole loop's reasoning
    ("qwen3-no-thinking", "chat_turn"): "<think>",  # the empty think block of the generation prompt is not in history
    ("qwen3-no-thinking", "tool_step"): "<think>",
    ("qwen3-no-thinking", "answer_after_tool"): "<think>",
    ("qwen3-coder", "chat_turn"): None,
    ("qwen3-coder", "tool_step"): None,
    ("qwen3-coder", "answer_after_tool"): None,
    ("qwen3.6", "chat_turn"): None,
    ("qwen3.6", "tool_step"): None,
    ("qwen3.6", "answer_after_tool"): None,
    ("qwen3.6-no-preserve", "chat_turn"): "<think>\n",  # reasoning before the last user query is dropped
    ("qwen3.6-no-preserve", "tool_step"): None,  # inside a tool loop the echoed reasoning is kept
    ("qwen3.6-no-preserve", "answer_after_tool"): "<think>\n",
    ("qwen3.6-no-thinking", "chat_turn"): None,  # the empty block of the generation prompt is rendered in history
    ("qwen3.6-no-thinking", "tool_step"): None,
    ("qwen3.6-no-thinking", "answer_after_tool"): None,
    ("deepseek-v3", "chat_turn"): None,
    ("deepseek-v3", "tool_step"): "<｜tool▁calls▁end｜>",  # a single call is never closed in history
    ("deepseek-v3", "answer_after_tool"): None,
    ("deepseek-v3-0324", "chat_turn"): None,
    ("deepseek-v3-0324", "tool_step"): None,
    ("deepseek-v3-0324", "answer_after_tool"): None,
    ("deepseek-v3.1", "chat_turn"): None,
    ("deepseek-v3.1", "tool_step"): None,
    ("deepseek-v3.1", "answer_after_tool"): None,
    ("deepseek-v3.1-thinking", "chat_turn"): "<think>",  # history is re-rendered as `<｜Assistant｜></think>answer`
    ("deepseek-r1", "chat_turn"): "<think>\n",  # the forced `<think>\n` and the reasoning are dropped
    ("deepseek-r1", "tool_step"): "<think>\n",
    ("deepseek-r1", "answer_after_tool"): REASONING,  # after tool outputs there is no generation prompt to lose
    ("deepseek-r1-0528", "chat_turn"): "<think>",  # reasoning stripped from every assistant message
    ("deepseek-r1-0528", "tool_step"): "<think>",
    ("deepseek-r1-0528", "answer_after_tool"): "<think>",
    ("deepseek-r1-distill", "chat_turn"): "<think>\n",
    ("deepseek-r1-distill", "tool_step"): "<think>\n",
    ("deepseek-r1-distill", "answer_after_tool"): REASONING,
}


def first_difference(old: str, new: str) -> int:
    return next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new)))


@pytest.mark.parametrize(("mode_name", "scenario"), sorted(EXPECTED))
def test_next_turn_prefix(mode_name: str, scenario: str) -> None:
    mode = MODES[mode_name]
    renderer = get_renderer(mode.family)
    history, output, next_message = SCENARIOS[scenario](mode)
    prompt = renderer.render(history, TOOLS, True, **mode.kwargs)
    old = prompt + output.raw
    new = renderer.render([*history, output.message, next_message], TOOLS, True, **mode.kwargs)
    expected_break = EXPECTED[(mode_name, scenario)]
    if expected_break is None:
        assert new.startswith(old), f"prefix broken at {first_difference(old, new)}: {old[first_difference(old, new):]!r}"
    else:
        assert not new.startswith(old)
        at = first_difference(old, new)
        # The break lies in `expected_break` (bytes can agree for a while inside it, e.g. `<｜tool▁` of two markers).
        start = old.find(expected_break, max(0, at - len(expected_break) + 1))
        assert 0 <= start <= at, f"break moved: old text there is {old[at - 10:at + 40]!r}"


def test_every_mode_has_every_applicable_scenario() -> None:
    for name, mode in MODES.items():
        for scenario in SCENARIOS:
            applicable = mode.call is not None or scenario == "chat_turn"
            assert ((name, scenario) in EXPECTED) == applicable, (name, scenario)


def test_qwen_argument_bytes() -> None:
    """Qwen3 keeps argument strings verbatim (prefix-stable for any JSON layout); Qwen2.5 can only re-serialize."""
    compact = '{"city":"Paris"}'
    for family, stable in (("qwen3", True), ("qwen2.5", False)):
        output = qwen_call(args_text=compact)
        renderer = get_renderer(family)
        old = renderer.render([QUESTION], TOOLS) + output.raw
        new = renderer.render([QUESTION, output.message, TOOL_RESULT], TOOLS)
        assert new.startswith(old) is stable, family
