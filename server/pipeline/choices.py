"""The server pipeline's shared core, API-neutral: engine outputs -> each choice's parsed deltas (answer text,
reasoning, tool-call starts and argument fragments, `server.parsing.Delta`), the output items they build, how the
choice finished (`Finish`). Chat completions, Anthropic messages and OpenAI responses are thin adapters: each makes
its request a turn (server/pipeline/turn.py), which server/api/chat.py plans, and formats `parsed_updates` and the final state in
its wire shape.
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from engine.text.output_processor import CompletionOutput
from engine.outputs import FinishReason
from server.pipeline.async_engine import RequestStream
from server.pipeline.context import ServingContext
from server.pipeline.generation import outputs
from server.parsing import Delta, OutputItem, OutputParser, get_output_parser, new_id_prefix

if TYPE_CHECKING:
    from server.pipeline.plan import Plan


@dataclass
class ChoiceState:
    """One choice of a chat plan: its parser (which holds the parsed output) and its engine output."""

    parser: OutputParser
    output: CompletionOutput  # the prompt's accumulation of this choice's tokens (`Generation.choices`)
    structured: bool = False  # the answer is JSON or follows a grammar
    unsent_logprobs: list = field(default_factory=list)  # logprobs of tokens whose text the parser still holds

    @property
    def items(self) -> list[OutputItem]:
        return self.parser.items

    @property
    def num_tokens(self) -> int:
        return len(self.output.token_ids)

    def message(self) -> dict:
        """The assistant message in the chat-completions shape (content null when only calls were made)."""
        parsed = self.parser.result()
        calls = parsed.tool_calls
        message: dict = {"role": "assistant", "content": parsed.content}
        if parsed.reasoning_content:
            message["reasoning_content"] = parsed.reasoning_content
        if calls:
            message["tool_calls"] = calls
        return message

    def finish(self, requested: int | None) -> Finish:
        """How the choice ended, API-neutral; ``requested``: the request's own token limit (`max_tokens`, ...)."""
        return Finish(self.finish_reason(), self._cut_by_request(requested), self.output.stop_str)

    def _cut_by_request(self, requested: int | None) -> bool:
        """Whether the agent APIs report the output as cut (`max_tokens`, `incomplete`): it stopped at the request's
        own token limit, not at one of the server's (the context's room, `--max-output-tokens`), since agents treat
        a cut reply as a failed turn (Claude Code asks the model to resume, Codex retries) and a server-side cut is
        reported as a finished turn. A structured answer cut anywhere is always reported: its text does not parse."""
        if self.finish_reason() != "length":
            return False
        return self.structured or (requested is not None and self.num_tokens >= requested)

    def finish_reason(self) -> str | None:
        if self.parser.limited or (self.output.finish_reason == "stop" and self.parser.result().tool_calls):
            return "tool_calls"
        return self.output.finish_reason


@dataclass(frozen=True)
class Finish:
    """How a choice ended, and its spelling in each API (the one finish-reason mapping)."""

    reason: str | None  # chat completions' finish_reason: stop, length, tool_calls (abort, error)
    cut_by_request: bool  # the request's own token limit cut it (see `ChoiceState._cut_by_request`)
    stop_sequence: str | None  # the stop string that ended it

    def anthropic(self) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence). Only the request's own max_tokens is `max_tokens`."""
        if self.reason == "tool_calls":
            return "tool_use", None
        if self.cut_by_request:
            return "max_tokens", None
        if self.stop_sequence is not None:
            return "stop_sequence", self.stop_sequence
        return "end_turn", None

    def responses_status(self) -> str:
        """`incomplete` when the request's own `max_output_tokens` cut the reply (a server-side cut is `completed`:
        Codex fails the whole turn on `incomplete`)."""
        return "incomplete" if self.cut_by_request else "completed"


@dataclass
class ChoiceUpdate:
    index: int
    state: ChoiceState
    deltas: list[Delta]
    finish_reason: str | None = None  # set on the choice's last update only


def choice_states(ctx: ServingContext, plan: Plan, streaming: bool) -> list[ChoiceState]:
    """One parser per choice. ``streaming``: a call the output cuts off once its name was sent is closed into valid
    JSON; otherwise such a call is dropped (never content). tool_choice was validated when the prompt was planned;
    one id prefix per choice keeps call ids unique."""
    turn = plan.turn
    max_calls = 1 if turn.parallel_tool_calls is False else None
    return [
        ChoiceState(get_output_parser(ctx.family, turn.tools, turn.tool_choice, reasoning=plan.thinking,
                                      id_prefix=new_id_prefix(), streaming=streaming, max_calls=max_calls),
                    output, structured=turn.structured_answer)
        for output in plan.generation.choices
    ]


async def parsed_updates(
    ctx: ServingContext, plan: Plan, stream: RequestStream, states: list[ChoiceState]
) -> AsyncIterator[ChoiceUpdate]:
    """Parsed deltas for every engine output, in step order; each choice's last update carries its finish reason.
    A choice cut at its call limit ends there; once every choice has ended the engine request is aborted."""
    open_choices = len(states)
    async for _, out in outputs(stream, [plan.generation]):
        state = states[out.index]
        state.unsent_logprobs += out.new_logprobs
        deltas = state.parser.feed(out.new_text) if out.new_text else []
        if out.finished:
            deltas += state.parser.finish(cut=out.finish_reason == FinishReason.LENGTH)
        ended = out.finished or state.parser.limited
        if ended:
            plan.generation.end_choice(out.index)
        if ended and out.index == 0 and state.finish_reason() == "tool_calls":
            stream.hold(ctx.engine.facts.tool_call_ttl)  # the next turn brings the tool's result
        yield ChoiceUpdate(out.index, state, deltas, state.finish_reason() if ended else None)
        open_choices -= ended
        if not open_choices:
            return  # leaving `outputs` aborts what still runs


@dataclass(frozen=True)
class ItemEvent:
    """An output item starts, grows by one delta, or stops (its text is whole then)."""

    kind: Literal["start", "delta", "stop"]
    index: int  # the item's
    item: OutputItem
    delta: Delta | None = None  # for "delta"


class ItemStream:
    """Frames a choice's deltas as item events, what Anthropic's content blocks and Responses' output items both
    stream: an item starts with its first delta and stops when the next one starts or the output ends."""

    def __init__(self, state: ChoiceState) -> None:
        self._items = state.items
        self._open = -1  # the index of the item that has started and not stopped
        self._started = 0

    def add(self, delta: Delta) -> list[ItemEvent]:
        events = []
        if delta.item >= self._started:
            events += self.close()
            self._open, self._started = delta.item, delta.item + 1
            events.append(ItemEvent("start", delta.item, self._items[delta.item]))
        if delta.kind != "call":
            events.append(ItemEvent("delta", delta.item, self._items[delta.item], delta))
        return events

    def close(self) -> list[ItemEvent]:
        if self._open < 0:
            return []
        index, self._open = self._open, -1
        return [ItemEvent("stop", index, self._items[index])]
