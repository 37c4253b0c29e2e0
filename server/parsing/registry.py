"""Which tool-call format and reasoning parser each template family uses."""
from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass

from server.parsing.deltas import ParsedMessage
from server.parsing.deepseek import DeepSeekV3Format, DeepSeekV31Format
from server.parsing.qwen3_coder_xml import Qwen3CoderFormat
from server.parsing.qwen_json import QwenJsonFormat
from server.parsing.reasoning import ThinkReasoningParser
from server.parsing.stream import OutputParser
from server.parsing.tool_choice import ToolChoice, forced_call_prefix, parse_tool_choice
from server.parsing.tool_stream import ToolFormat


@dataclass(frozen=True)
class Thinking:
    """How a family thinks. `switchable`: a request turns it on or off (else it is always on); `default`: its value
    when the request says nothing; `starts_inside`: the output starts inside reasoning (the prompt opened `<think>`,
    or the model opens it itself and never answers without it); `prompt_close`: what closes the block the generation
    prompt opened, written before a forced tool call."""

    switchable: bool
    default: bool
    starts_inside: bool
    prompt_close: str = ""


@dataclass(frozen=True)
class FamilyParsing:
    tool_format: Callable[[list[dict] | None], ToolFormat]
    thinking: Thinking | None = None


_QWEN_JSON = lambda tools: QwenJsonFormat()  # noqa: E731
_DEEPSEEK_V3 = lambda tools: DeepSeekV3Format()  # noqa: E731
_R1_THINKING = Thinking(switchable=False, default=True, starts_inside=True, prompt_close="\n</think>\n\n")

FAMILIES: dict[str, FamilyParsing] = {
    "qwen2.5": FamilyParsing(_QWEN_JSON),
    "qwen3": FamilyParsing(_QWEN_JSON, Thinking(switchable=True, default=True, starts_inside=False)),
    "qwen3-coder": FamilyParsing(Qwen3CoderFormat),
    "deepseek-v3": FamilyParsing(_DEEPSEEK_V3),
    "deepseek-v3-0324": FamilyParsing(_DEEPSEEK_V3),
    "deepseek-v3.1": FamilyParsing(
        lambda tools: DeepSeekV31Format(),
        Thinking(switchable=True, default=False, starts_inside=True, prompt_close="</think>"),
    ),
    "deepseek-r1": FamilyParsing(_DEEPSEEK_V3, _R1_THINKING),
    # R1-0528's generation prompt does not open <think>; the model writes it itself.
    "deepseek-r1-0528": FamilyParsing(_DEEPSEEK_V3, Thinking(switchable=False, default=True, starts_inside=True)),
    "deepseek-r1-distill": FamilyParsing(_DEEPSEEK_V3, _R1_THINKING),
    # Any other model's own Jinja template: Hermes-style <tool_call> JSON is the de-facto format when it has one.
    "jinja": FamilyParsing(_QWEN_JSON),
}


def family_parsing(family: str) -> FamilyParsing:
    try:
        return FAMILIES[family]
    except KeyError:
        raise ValueError(f"unknown template family {family!r} (known: {', '.join(FAMILIES)})") from None


def default_thinking(family: str) -> bool:
    thinking = family_parsing(family).thinking
    return thinking is not None and thinking.default


def _active_thinking(spec: FamilyParsing, reasoning: bool) -> Thinking | None:
    """The family's thinking when this request thinks (asked for, or a family that always does)."""
    if spec.thinking is not None and (reasoning or not spec.thinking.switchable):
        return spec.thinking
    return None


def tool_call_prompt_suffix(
    family: str, tool_choice: str | dict | None, tools: list[dict] | None, *, reasoning: bool = False
) -> str:
    """Text to append to the rendered prompt so that generation starts inside a call (`required`, or a named
    function); '' otherwise. Raises ValueError for an invalid `tool_choice`."""
    spec = family_parsing(family)
    choice = parse_tool_choice(tool_choice, tools)
    prefix = forced_call_prefix(spec.tool_format(tools), choice)
    thinking = _active_thinking(spec, reasoning)
    return thinking.prompt_close + prefix if prefix and thinking else prefix


def get_output_parser(
    family: str,
    tools: list[dict] | None,
    tool_choice: str | dict | None = None,
    *,
    reasoning: bool,
    id_prefix: str,
) -> OutputParser:
    """The parser for one request's output. `reasoning`: thinking is on for this request (Qwen3 `enable_thinking`,
    V3.1 `thinking`; the R1 family always thinks). Raises ValueError for an unknown family or invalid tool_choice."""
    spec = family_parsing(family)
    choice: ToolChoice = parse_tool_choice(tool_choice, tools)
    fmt = spec.tool_format(tools) if choice.parses_calls else None
    prefix = forced_call_prefix(fmt, choice) if fmt else ""
    thinking = _active_thinking(spec, reasoning)
    think = None
    # A forced call starts the output inside the call: the suffix already closed any reasoning.
    if thinking and not prefix:
        think = ThinkReasoningParser(starts_in_reasoning=thinking.starts_inside)
    return OutputParser(tool_format=fmt, reasoning=think, id_prefix=id_prefix, prefix=prefix)


def new_id_prefix() -> str:
    """A per-request random prefix for tool call ids."""
    return secrets.token_hex(6)


def parse_output(
    family: str,
    text: str,
    tools: list[dict] | None = None,
    tool_choice: str | dict | None = None,
    *,
    reasoning: bool,
    id_prefix: str,
) -> ParsedMessage:
    """Non-streaming convenience: the whole output at once, as a `ParsedMessage`."""
    parser = get_output_parser(family, tools, tool_choice, reasoning=reasoning, id_prefix=id_prefix)
    parser.feed(text)
    parser.finish()
    return parser.result()
