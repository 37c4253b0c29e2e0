"""The combined output parser: end-of-turn stripping, then reasoning, then tool calls, as neutral deltas."""
from __future__ import annotations

from server.parsing.deltas import Delta, DeltaKind, OutputItem, OutputItems, ParsedMessage, merge, tool_call_id
from server.parsing.end_of_turn import END_OF_TURN_TOKENS, EndOfTurnStripper
from server.parsing.reasoning import ChannelText, ThinkReasoningParser
from server.parsing.tool_stream import CallStart, PlainContent, ToolCallStream, ToolEvent, ToolFormat


class OutputParser:
    """Feed the detokenized output text in any pieces; get `Delta`s back, and the `OutputItem`s they build.

    - `tool_format`: None means nothing is parsed as a tool call (no tools, or `tool_choice` "none").
    - `reasoning`: None for no reasoning parser, else a `ThinkReasoningParser`.
    - `streaming`: calls stream as the model writes them; else each is reported once whole (see `ToolCallStream`).
    - `max_calls`: a call beyond it ends the output there (`limited`; parallel tool calls off: 1).
    - `end_of_turn`: the tokens that end the reply (GLM also ends a turn at `<|user|>` / `<|observation|>`);
      `dropped`: markup around the reply that is not part of it (Kimi-K3's response channel tags).
    The deltas concatenate to `result()`, and both are the same however the text is split.
    """

    def __init__(
        self,
        *,
        tool_format: ToolFormat | None,
        reasoning: ThinkReasoningParser | None,
        id_prefix: str,
        streaming: bool = True,
        max_calls: int | None = None,
        end_of_turn: tuple[str, ...] = END_OF_TURN_TOKENS,
        dropped: tuple[str, ...] = (),
    ):
        self._end_of_turn = EndOfTurnStripper(end_of_turn, dropped)
        self._reasoning = reasoning
        self._tools: ToolCallStream | PlainContent = (
            ToolCallStream(tool_format, streaming) if tool_format else PlainContent()
        )
        self._id_prefix = id_prefix
        self._max_calls = max_calls
        self._output = OutputItems()
        self.limited = False  # a call beyond max_calls ended the output
        self._finished = False

    @property
    def items(self) -> list[OutputItem]:
        """The output so far, item by item (an item's text may still grow until the next one starts)."""
        return self._output.items

    def feed(self, delta: str) -> list[Delta]:
        if self._finished:
            raise RuntimeError("OutputParser.feed after finish")
        return merge(self._run(delta, final=False))

    def finish(self, cut: bool = False) -> list[Delta]:
        """The end of the output; ``cut``: a token limit ended it (a call it cut off is dropped, never content)."""
        if self._finished:
            return []
        deltas = merge(self._run("", final=True, cut=cut))
        self._finished = True
        return deltas

    def result(self) -> ParsedMessage:
        if not self._finished:
            raise RuntimeError("OutputParser.result before finish")
        return ParsedMessage.of(self.items)

    def _run(self, text: str, final: bool, cut: bool = False) -> list[Delta]:
        text = self._end_of_turn.feed(text)
        if final:
            text += self._end_of_turn.finish()
        if self._reasoning is None:
            channels: list[ChannelText] = [("content", text)] if text else []
        else:
            channels = self._reasoning.feed(text) + (self._reasoning.finish() if final else [])
        deltas: list[Delta] = []
        for channel, piece in channels:
            if channel == "reasoning":
                deltas += self._add("reasoning", piece)
            else:
                deltas += self._tool_deltas(self._tools.feed(piece))
        if final:
            deltas += self._tool_deltas(self._tools.finish(cut))
        if self.limited:
            self._finished = True
        return deltas

    def _add(self, kind: DeltaKind, text: str, call_id: str = "") -> list[Delta]:
        return [] if self.limited else [self._output.add(kind, text, call_id)]

    def _tool_deltas(self, events: list[ToolEvent]) -> list[Delta]:
        deltas: list[Delta] = []
        for event in events:
            if isinstance(event, str):
                deltas += self._add("text", event)
            elif isinstance(event, CallStart):
                calls = self._output.num_calls
                if self._max_calls is not None and calls >= self._max_calls:
                    self.limited = True
                deltas += self._add("call", event.name, event.call_id or tool_call_id(self._id_prefix, calls))
            else:
                deltas += self._add("arguments", event.text)
        return deltas
