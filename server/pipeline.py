"""The chat pipeline's shared core: engine outputs -> parsed deltas per choice (answer text, reasoning, tool-call
starts and argument fragments) and each choice's finish reason. Chat completions, Anthropic messages and OpenAI
responses all consume `parsed_updates` and only format what it yields in their own wire shape.
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from engine.output_processor import CompletionOutput
from engine.outputs import FinishReason
from server.async_engine import RequestStream
from server.context import ServingContext
from server.generation import outputs
from server.parsing import OutputParser, get_output_parser, new_id_prefix

if TYPE_CHECKING:
    from server.chat import ChatPlan

DeltaKind = Literal["text", "reasoning", "call", "arguments"]


@dataclass(frozen=True)
class Delta:
    """One parsed piece of output, API-neutral. `text` is the answer text, the reasoning text, the called function's
    name (kind "call", which starts call `call_index` with id `call_id`) or an arguments fragment of that call."""

    kind: DeltaKind
    text: str
    call_index: int = -1
    call_id: str = ""

    @classmethod
    def of(cls, delta: dict) -> Delta:
        """From the parser's OpenAI chat delta dict."""
        if "content" in delta:
            return cls("text", delta["content"])
        if "reasoning_content" in delta:
            return cls("reasoning", delta["reasoning_content"])
        call = delta["tool_calls"][0]
        if "id" in call:
            return cls("call", call["function"]["name"], call["index"], call["id"])
        return cls("arguments", call["function"]["arguments"], call["index"])


@dataclass
class ChoiceState:
    parser: OutputParser
    max_calls: int | None  # None: any number of tool calls; 1 when parallel calls are off
    choice: CompletionOutput = field(default_factory=CompletionOutput)
    unsent_logprobs: list = field(default_factory=list)  # logprobs of tokens whose text the parser still holds
    content: str = ""  # the answer text and reasoning streamed so far (what the deltas concatenate to)
    reasoning: str = ""
    calls: int = 0
    cut: bool = False  # stopped early at the call limit
    structured: bool = False  # the answer is JSON or follows a grammar

    def take(self, deltas: list[dict]) -> list[dict]:
        """The deltas up to the call limit; a call beyond it ends the choice (the rest of the output is dropped)."""
        kept = []
        for delta in deltas:
            if "tool_calls" in delta and "id" in delta["tool_calls"][0]:
                if self.max_calls is not None and self.calls >= self.max_calls:
                    self.cut = True
                    break
                self.calls += 1
            self.content += delta.get("content", "")
            self.reasoning += delta.get("reasoning_content", "")
            kept.append(delta)
        return kept

    def tool_calls(self) -> list[dict]:
        calls = self.parser.result().tool_calls
        return calls if self.max_calls is None else calls[: self.max_calls]

    def message(self) -> dict:
        """The assistant message in the chat-completions shape (content null when only calls were made)."""
        calls = self.tool_calls()
        message: dict = {"role": "assistant", "content": self.content if self.content or not calls else None}
        if self.reasoning:
            message["reasoning_content"] = self.reasoning
        if calls:
            message["tool_calls"] = calls
        return message

    def finish(self, requested: int | None) -> Finish:
        """How the choice ended, API-neutral; ``requested``: the request's own token limit (`max_tokens`, ...)."""
        return Finish(self.finish_reason(), self._cut_by_request(requested), self.choice.stop_str)

    def _cut_by_request(self, requested: int | None) -> bool:
        """Whether the agent APIs report the output as cut (`max_tokens`, `incomplete`): it stopped at the request's
        own token limit, not at one of the server's (the context's room, `--max-output-tokens`), since agents treat
        a cut reply as a failed turn (Claude Code asks the model to resume, Codex retries) and a server-side cut is
        reported as a finished turn. A structured answer cut anywhere is always reported: its text does not parse."""
        if self.finish_reason() != "length":
            return False
        return self.structured or (requested is not None and len(self.choice.token_ids) >= requested)

    def finish_reason(self) -> str | None:
        if self.cut or (self.choice.finish_reason == "stop" and self.parser.result().finish_reason_override):
            return "tool_calls"
        return self.choice.finish_reason


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
    deltas: list[dict]  # the parser's OpenAI chat delta dicts (`Delta.of` gives the neutral view)
    finish_reason: str | None = None  # set on the choice's last update only


def choice_states(ctx: ServingContext, plan: ChatPlan, streaming: bool) -> list[ChoiceState]:
    """One parser per choice. ``streaming``: a call the output cuts off once its name was sent is closed into valid
    JSON; otherwise such a call is dropped (never content). tool_choice was validated when the prompt was planned; one id
    prefix per choice keeps call ids unique."""
    req = plan.req
    max_calls = 1 if req.parallel_tool_calls is False else None
    return [
        ChoiceState(get_output_parser(ctx.family, req.tools, req.tool_choice, reasoning=plan.thinking,
                                      id_prefix=new_id_prefix(), streaming=streaming), max_calls,
                    structured=req.structured_answer)
        for _ in range(req.n)
    ]


def _held(plan: ChatPlan) -> bool:
    retention = plan.prompt.request.retention
    return retention is not None and retention.hold_after_finish_s > 0


async def parsed_updates(
    ctx: ServingContext, plan: ChatPlan, stream: RequestStream, states: list[ChoiceState]
) -> AsyncIterator[ChoiceUpdate]:
    """Parsed deltas for every engine output, in step order; each choice's last update carries its finish reason.
    A choice cut at its call limit ends there; once every choice has ended the engine request is aborted."""
    open_choices = len(states)
    async for _, out in outputs(stream, [plan.prompt]):
        state = states[out.index]
        if state.cut:
            continue
        state.choice.add(out)
        state.unsent_logprobs += out.new_logprobs
        deltas = state.parser.feed(out.new_text) if out.new_text else []
        if out.finished:
            deltas += state.parser.finish(cut=out.finish_reason == FinishReason.LENGTH)
        deltas = state.take(deltas)
        if state.cut and not out.finished:
            state.parser.finish()
        ended = out.finished or state.cut
        if ended and out.index == 0 and state.finish_reason() == "tool_calls" and _held(plan):
            ctx.engine.retain_after_tool_call(plan.request_id)  # the next turn brings the tool's result
        yield ChoiceUpdate(out.index, state, deltas, state.finish_reason() if ended else None)
        open_choices -= ended
        if not open_choices:
            return  # leaving `outputs` aborts what still runs
