"""Which tool-call format and reasoning parser each template family uses."""
from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass

from server.parsing.deltas import ParsedMessage
from server.parsing.end_of_turn import END_OF_TURN_TOKENS
from server.parsing.formats.deepseek import DeepSeekV3Format, DeepSeekV31Format
from server.parsing.formats.dsml import DsmlFormat
from server.parsing.formats.gemma4 import Gemma4Format
from server.parsing.formats.gemma_json import GemmaJsonFormat
from server.parsing.formats.glm_xml import GlmFormat
from server.parsing.formats.harmony import HarmonyFormat, HarmonyOutputParser
from server.parsing.formats.kimi import KimiFormat
from server.parsing.formats.kimi_k3 import END_OF_TURN as KIMI_K3_END_OF_TURN
from server.parsing.formats.kimi_k3 import RESPONSE_TAGS as KIMI_K3_RESPONSE_TAGS
from server.parsing.formats.kimi_k3 import THINK_TAGS as KIMI_K3_THINK_TAGS
from server.parsing.formats.kimi_k3 import KimiK3Format
from server.parsing.formats.minimax_xml import MinimaxFormat
from server.parsing.formats.mistral import EOS as MISTRAL_EOS
from server.parsing.formats.mistral import MistralFormat
from server.parsing.formats.qwen3_coder_xml import Qwen3CoderFormat
from server.parsing.formats.qwen_json import QwenJsonFormat
from server.parsing.reasoning import THINK_CLOSE, THINK_OPEN, ThinkReasoningParser
from server.parsing.stream import OutputParser
from server.parsing.tool_choice import ToolChoice, parse_tool_choice
from server.parsing.tool_stream import ToolFormat


@dataclass(frozen=True)
class Thinking:
    """How a family thinks. `switchable`: a request turns it on or off (else it is always on); `default`: its value
    when the request says nothing; `starts_inside`: the output starts inside reasoning (the prompt opened `<think>`,
    or the model opens it itself and never answers without it)."""

    switchable: bool
    default: bool
    starts_inside: bool
    tags: tuple[str, str] = (THINK_OPEN, THINK_CLOSE)  # what opens and closes the reasoning
    # The model opens its reasoning itself in every turn, as the template writes it in every assistant turn (Kimi):
    # a grammar has it write the opening too, so the turn renders back as it was written.
    model_opens: bool = False
    # The template writes newlines around the reasoning itself (Qwen's `<think>⏎…⏎</think>⏎⏎`), so the parser drops the
    # model's; Kimi's writes `<think>REASONING</think>ANSWER` verbatim, so they are kept.
    trims_newlines: bool = True
    # What a grammar lets the model write between the reasoning's close and the answer: the templates write up to a
    # blank line there; Kimi-K3's channels are back to back.
    gap: str = r"\n{0,2}"


@dataclass(frozen=True)
class FamilyParsing:
    tool_format: Callable[[list[dict] | None], ToolFormat]
    thinking: Thinking | None = None
    end_of_turn: tuple[str, ...] = END_OF_TURN_TOKENS  # the tokens after which the output is not the reply
    # A format whose messages carry their own channels (gpt-oss' harmony): one parser reads reasoning, text and calls
    channel_parser: type[HarmonyOutputParser] | None = None
    dropped: tuple[str, ...] = ()  # markup around the answer that is not content (Kimi-K3's response channel tags)


_QWEN_JSON = lambda tools: QwenJsonFormat()  # noqa: E731
_DEEPSEEK_V3 = lambda tools: DeepSeekV3Format()  # noqa: E731
_R1_THINKING = Thinking(switchable=False, default=True, starts_inside=True)
_DEEPSEEK_THINKING = Thinking(switchable=True, default=False, starts_inside=True)

FAMILIES: dict[str, FamilyParsing] = {
    "qwen2.5": FamilyParsing(_QWEN_JSON),
    "qwen3": FamilyParsing(_QWEN_JSON, Thinking(switchable=True, default=True, starts_inside=False)),
    "qwen3-coder": FamilyParsing(Qwen3CoderFormat),
    # Qwen3.5/3.6: Qwen3-Coder's XML calls; the generation prompt opens <think> unless enable_thinking is false.
    "qwen3.6": FamilyParsing(Qwen3CoderFormat, Thinking(switchable=True, default=True, starts_inside=True)),
    "deepseek-v3": FamilyParsing(_DEEPSEEK_V3),
    "deepseek-v3-0324": FamilyParsing(_DEEPSEEK_V3),
    "deepseek-v3.1": FamilyParsing(lambda tools: DeepSeekV31Format(), _DEEPSEEK_THINKING),
    # V3.2 / V4: DSML calls; thinking (off unless asked for) starts inside the <think> the prompt opened.
    "deepseek-v3.2": FamilyParsing(lambda tools: DsmlFormat("function_calls", tools), _DEEPSEEK_THINKING),
    "deepseek-v4": FamilyParsing(lambda tools: DsmlFormat("tool_calls", tools), _DEEPSEEK_THINKING),
    "deepseek-r1": FamilyParsing(_DEEPSEEK_V3, _R1_THINKING),
    # R1-0528's generation prompt does not open <think>; the model writes it itself.
    "deepseek-r1-0528": FamilyParsing(_DEEPSEEK_V3, Thinking(switchable=False, default=True, starts_inside=True)),
    "deepseek-r1-distill": FamilyParsing(_DEEPSEEK_V3, _R1_THINKING),
    # GLM-4.7: <arg_key>/<arg_value> calls typed by the tools' schemas; the generation prompt opens <think> unless
    # enable_thinking is false; the model ends a turn with the next turn's role token (<|user|>, <|observation|>).
    "glm-4.7": FamilyParsing(GlmFormat, Thinking(switchable=True, default=True, starts_inside=True),
                             END_OF_TURN_TOKENS + ("<|user|>", "<|observation|>")),
    # MiniMax-M2 / M2.5: <invoke>/<parameter> calls in one <minimax:tool_call> block, typed by the tools' schemas; it
    # always thinks (the generation prompt opens <think>) and ends its turn with [e~[.
    "minimax-m2": FamilyParsing(MinimaxFormat, Thinking(switchable=False, default=True, starts_inside=True),
                                END_OF_TURN_TOKENS + ("[e~[",)),
    # Kimi-K2 / Kimi Linear: a <|tool_calls_section_begin|> section of calls whose ids are the model's
    # functions.NAME:IDX headers; the model opens its <think> itself, as its template writes one in every assistant
    # turn; it ends its turn with <|im_end|>.
    "kimi-k2": FamilyParsing(KimiFormat, Thinking(switchable=False, default=True, starts_inside=False,
                                                  model_opens=True, trims_newlines=False)),
    # Kimi-K3: XTML channels; the generation prompt opens the think channel (kvserve's K3 always thinks, as Moonshot's
    # API runs it), the answer is the response channel, calls the tools channel; <|close|>message<|sep|> ends a turn.
    "kimi-k3": FamilyParsing(KimiK3Format, Thinking(switchable=False, default=True, starts_inside=True,
                                                    tags=KIMI_K3_THINK_TAGS, trims_newlines=False, gap=""),
                             END_OF_TURN_TOKENS + KIMI_K3_END_OF_TURN, dropped=KIMI_K3_RESPONSE_TAGS),
    # gpt-oss: harmony messages; reasoning on the analysis channel, calls addressed to functions.NAME.
    "gpt-oss": FamilyParsing(lambda tools: HarmonyFormat(), channel_parser=HarmonyOutputParser),
    # Devstral Small 2 / Devstral 2: [TOOL_CALLS]NAME[ARGS]{...} calls back to back, the turn ending with </s>.
    "devstral": FamilyParsing(MistralFormat, end_of_turn=END_OF_TURN_TOKENS + (MISTRAL_EOS,)),
    # Gemma 3: the JSON calls its function-calling guide prompts for ({"name": ..., "parameters": {...}}); the model
    # ends its turn with <end_of_turn>.
    "gemma3": FamilyParsing(GemmaJsonFormat, end_of_turn=END_OF_TURN_TOKENS + ("<end_of_turn>",)),
    # Gemma 4: <|tool_call>call:NAME{key:value}<tool_call|> in its own notation, typed by the tools' schemas; with
    # enable_thinking (off unless asked for) the model opens <|channel>thought itself; it ends its turn with <turn|>.
    "gemma4": FamilyParsing(Gemma4Format, Thinking(switchable=True, default=False, starts_inside=False,
                                                   tags=("<|channel>thought", "<channel|>")),
                            END_OF_TURN_TOKENS + ("<turn|>",)),
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


def active_thinking(family: str, reasoning: bool) -> Thinking | None:
    """The family's thinking when this request thinks (asked for, or a family that always does)."""
    thinking = family_parsing(family).thinking
    if thinking is not None and (reasoning or not thinking.switchable):
        return thinking
    return None


def get_output_parser(
    family: str,
    tools: list[dict] | None,
    tool_choice: str | dict | None = None,
    *,
    reasoning: bool,
    id_prefix: str,
    streaming: bool = True,
    max_calls: int | None = None,
) -> OutputParser:
    """The parser for one request's output. `reasoning`: thinking is on for this request (Qwen3 `enable_thinking`,
    V3.1 `thinking`; the R1 family always thinks). `streaming`: calls stream as they are written (a call the output
    cuts off still ends with valid JSON arguments); else a call is reported once it is complete. A call the output
    cuts off never becomes content when `finish(cut=True)` says a token limit ended it. `max_calls`: the output ends at
    a call beyond it (1 when parallel tool calls are off). Raises ValueError for an unknown family or an invalid
    tool_choice."""
    spec = family_parsing(family)
    choice: ToolChoice = parse_tool_choice(tool_choice, tools)
    if spec.channel_parser is not None:
        return spec.channel_parser(parse_calls=choice.parses_calls, id_prefix=id_prefix, streaming=streaming,
                                   max_calls=max_calls)
    fmt = spec.tool_format(tools) if choice.parses_calls else None
    thinking = active_thinking(family, reasoning)
    think = ThinkReasoningParser(thinking.starts_inside, thinking.tags, thinking.trims_newlines) if thinking else None
    return OutputParser(tool_format=fmt, reasoning=think, id_prefix=id_prefix, streaming=streaming,
                        max_calls=max_calls, end_of_turn=spec.end_of_turn, dropped=spec.dropped)


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
    streaming: bool = False,
) -> ParsedMessage:
    """The whole output at once, as a `ParsedMessage`: what a non-streamed response returns, or with `streaming`
    what a client assembles from the streamed deltas."""
    parser = get_output_parser(
        family, tools, tool_choice, reasoning=reasoning, id_prefix=id_prefix, streaming=streaming
    )
    parser.feed(text)
    parser.finish()
    return parser.result()
