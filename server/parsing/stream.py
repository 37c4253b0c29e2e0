"""The combined output parser: end-of-turn stripping, then reasoning, then tool calls, as OpenAI deltas."""
from __future__ import annotations

from server.parsing.deltas import (
    ParsedMessage,
    content_delta,
    reasoning_delta,
    tool_call_arguments_delta,
    tool_call_dict,
    tool_call_id,
    tool_call_start_delta,
)
from server.parsing.end_of_turn import EndOfTurnStripper
from server.parsing.reasoning import ChannelText, ThinkReasoningParser
from server.parsing.tool_stream import CallStart, PlainContent, ToolCallStream, ToolEvent, ToolFormat


class OutputParser:
    """Feed the detokenized output text in any pieces; get OpenAI chat-completion delta dicts back.

    - `tool_format`: None means nothing is parsed as a tool call (no tools, or `tool_choice` "none").
    - `reasoning`: None for no reasoning parser, else a `ThinkReasoningParser`.
    - `streaming`: calls stream as the model writes them; else each is reported once whole (see `ToolCallStream`).
    The deltas concatenate to `result()`, and both are the same however the text is split.
    """

    def __init__(
        self,
        *,
        tool_format: ToolFormat | None,
        reasoning: ThinkReasoningParser | None,
        id_prefix: str,
        streaming: bool = True,
    ):
        self._end_of_turn = EndOfTurnStripper()
        self._reasoning = reasoning
        self._tools: ToolCallStream | PlainContent = (
            ToolCallStream(tool_format, streaming) if tool_format else PlainContent()
        )
        self._id_prefix = id_prefix
        self._content: list[str] = []
        self._reasoning_text: list[str] = []
        self._calls: list[dict] = []
        self._finished = False

    def feed(self, delta: str) -> list[dict]:
        if self._finished:
            raise RuntimeError("OutputParser.feed after finish")
        return _merge(self._run(delta, final=False))

    def finish(self, cut: bool = False) -> list[dict]:
        """The end of the output; ``cut``: a token limit ended it (a call it cut off is dropped, never content)."""
        if self._finished:
            return []
        self._finished = True
        return _merge(self._run("", final=True, cut=cut))

    def result(self) -> ParsedMessage:
        if not self._finished:
            raise RuntimeError("OutputParser.result before finish")
        content = "".join(self._content)
        reasoning = "".join(self._reasoning_text)
        return ParsedMessage(
            content=content if content or not self._calls else None,
            reasoning_content=reasoning or None,
            tool_calls=list(self._calls),
            finish_reason_override="tool_calls" if self._calls else None,
        )

    def _run(self, text: str, final: bool, cut: bool = False) -> list[dict]:
        text = self._end_of_turn.feed(text)
        if final:
            text += self._end_of_turn.finish()
        if self._reasoning is None:
            channels: list[ChannelText] = [("content", text)] if text else []
        else:
            channels = self._reasoning.feed(text) + (self._reasoning.finish() if final else [])
        deltas: list[dict] = []
        for channel, piece in channels:
            if channel == "reasoning":
                self._reasoning_text.append(piece)
                deltas.append(reasoning_delta(piece))
            else:
                deltas += self._tool_deltas(self._tools.feed(piece))
        if final:
            deltas += self._tool_deltas(self._tools.finish(cut))
        return deltas

    def _tool_deltas(self, events: list[ToolEvent]) -> list[dict]:
        deltas: list[dict] = []
        for event in events:
            if isinstance(event, str):
                self._content.append(event)
                deltas.append(content_delta(event))
            elif isinstance(event, CallStart):
                call_id = tool_call_id(self._id_prefix, len(self._calls))
                deltas.append(tool_call_start_delta(len(self._calls), call_id, event.name))
                self._calls.append(tool_call_dict(call_id, event.name))
            else:
                self._calls[-1]["function"]["arguments"] += event.text
                deltas.append(tool_call_arguments_delta(len(self._calls) - 1, event.text))
        return deltas


def _merge(deltas: list[dict]) -> list[dict]:
    """Joins neighbouring content (or reasoning, or one call's argument) deltas so one feed yields one per run."""
    out: list[dict] = []
    for delta in deltas:
        key = next(iter(delta))
        if out and key in ("content", "reasoning_content") and set(out[-1]) == {key}:
            out[-1] = {key: out[-1][key] + delta[key]}
        elif out and _is_arguments(delta) and _is_arguments(out[-1]) and _index(delta) == _index(out[-1]):
            out[-1] = tool_call_arguments_delta(_index(delta), _arguments(out[-1]) + _arguments(delta))
        else:
            out.append(delta)
    return out


def _is_arguments(delta: dict) -> bool:
    return "tool_calls" in delta and "id" not in delta["tool_calls"][0]


def _index(delta: dict) -> int:
    return delta["tool_calls"][0]["index"]


def _arguments(delta: dict) -> str:
    return delta["tool_calls"][0]["function"]["arguments"]
