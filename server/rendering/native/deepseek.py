"""Native renderers for the DeepSeek chat formats: V3 (Dec-2024), V3-0324, V3.1, R1 (Feb-2025), R1-0528, R1-Distill.

The official templates are small state machines over the message list (``ns.is_first``, ``ns.is_tool``, ...). Each
renderer here runs the same state machine in Python and reproduces the official bytes, bugs included (V3 and R1
never reset their first-call/first-output flags, so a second tool round is malformed; see NOTES.md §2.4-2.9). All
system messages are hoisted to the top. Tool descriptions, which the templates ignore, are merged into the system
prompt by ``prepare`` (see :mod:`server.rendering.native.deepseek_tools`).
"""
from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import Any

from server.rendering.base import Prepared, Renderer
from server.rendering.native.deepseek_tools import CallSyntax, tool_block, with_tool_system_prompt
from server.rendering.messages import MessagePolicy

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
TOOL_SEP = "<｜tool▁sep｜>"
CALL_END = "<｜tool▁call▁end｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
OUTPUTS_BEGIN = "<｜tool▁outputs▁begin｜>"
OUTPUT_BEGIN = "<｜tool▁output▁begin｜>"
OUTPUT_END = "<｜tool▁output▁end｜>"
OUTPUTS_END = "<｜tool▁outputs▁end｜>"


@dataclass
class _State:
    """The templates' ``ns`` namespace."""

    is_first: bool = False  # a tool call was already emitted (per conversation in V3/R1, per message later)
    is_tool: bool = False  # the previous message was a tool output
    is_output_first: bool = True  # no tool output emitted yet in the current block
    is_last_user: bool = False  # the previous non-system message was a user message


def fenced_call(call: dict) -> str:
    function = call["function"]
    return f"{CALL_BEGIN}{call['type']}{TOOL_SEP}{function['name']}\n```json\n{function['arguments']}\n```{CALL_END}"


def after_think(content: str) -> str:
    """R1-style reasoning removal: the text after the last ``</think>``."""
    return content.split("</think>")[-1]


class _DeepSeekRenderer(Renderer):
    """The loop shared by all DeepSeek templates; subclasses supply the per-role rendering."""

    policy = MessagePolicy(arguments="string")  # the templates concatenate `arguments` with `+`
    bos_token = BOS
    eos_token = EOS
    call_syntax: CallSyntax = "fenced"
    hoists_system_messages = True

    def prepare(self, messages: list[dict], tools: list[dict] | None = None) -> Prepared:
        prepared = super().prepare(messages, tools)
        if not prepared.tools:
            return prepared
        block = tool_block(prepared.tools, self.call_syntax)
        return Prepared(with_tool_system_prompt(prepared.messages, block), prepared.tools)

    def system_prompt(self, messages: list[dict]) -> str:
        return "\n\n".join(m["content"] for m in messages if m["role"] == "system")

    def render_prepared(self, prepared: Prepared, add_generation_prompt: bool, kwargs: dict[str, Any]) -> str:
        state = _State()
        out = [self.bos_token, self.system_prompt(prepared.messages)]
        for message in prepared.messages:
            role = message["role"]
            if role == "user":
                out.append(self.user(state, message["content"]))
            elif role == "assistant" and "tool_calls" in message:
                out.append(self.calls(state, message))
            elif role == "assistant":
                out.append(self.reply(state, message, kwargs))
            elif role == "tool":
                out.append(self.tool_output(state, message["content"]))
        out.append(self.ending(state, add_generation_prompt, kwargs))
        return "".join(out)

    @abstractmethod
    def user(self, state: _State, content: str) -> str: ...

    @abstractmethod
    def calls(self, state: _State, message: dict) -> str:
        """An assistant message with ``tool_calls``."""

    @abstractmethod
    def reply(self, state: _State, message: dict, kwargs: dict[str, Any]) -> str:
        """An assistant message without ``tool_calls``."""

    @abstractmethod
    def tool_output(self, state: _State, content: str) -> str: ...

    @abstractmethod
    def ending(self, state: _State, add_generation_prompt: bool, kwargs: dict[str, Any]) -> str:
        """What follows the last message: closing markers and the generation prompt."""


class DeepSeekV3Renderer(_DeepSeekRenderer):
    """DeepSeek-V3, Dec-2024 template. Calls render only when ``content is None`` (hence the policy), the calls-end
    marker follows every non-first call (so a single call is never closed), and the first-call/first-output flags
    are never reset."""

    family = "deepseek-v3"
    policy = MessagePolicy(arguments="string", null_content_with_calls=True)
    drop_reasoning = False  # R1 templates keep only the text after `</think>` of a plain reply
    output_separator = "\n"  # between consecutive tool outputs
    generation = ASSISTANT

    def user(self, state: _State, content: str) -> str:
        state.is_tool = False
        return USER + content

    def calls(self, state: _State, message: dict) -> str:
        state.is_tool = False
        out = []
        for call in message["tool_calls"]:
            if not state.is_first:
                out.append(ASSISTANT + CALLS_BEGIN + fenced_call(call))
                state.is_first = True
            else:
                out.append("\n" + fenced_call(call) + CALLS_END + EOS)
        return "".join(out)

    def reply(self, state: _State, message: dict, kwargs: dict[str, Any]) -> str:
        content = message["content"]
        if state.is_tool:
            state.is_tool = False
            return OUTPUTS_END + content + EOS
        return ASSISTANT + (after_think(content) if self.drop_reasoning else content) + EOS

    def tool_output(self, state: _State, content: str) -> str:
        state.is_tool = True
        if state.is_output_first:
            state.is_output_first = False
            return OUTPUTS_BEGIN + OUTPUT_BEGIN + content + OUTPUT_END
        return self.output_separator + OUTPUT_BEGIN + content + OUTPUT_END

    def ending(self, state: _State, add_generation_prompt: bool, kwargs: dict[str, Any]) -> str:
        if state.is_tool:
            return OUTPUTS_END
        return self.generation if add_generation_prompt else ""


class DeepSeekR1DistillRenderer(DeepSeekV3Renderer):
    """R1-Distill (Feb-2025): V3's tool handling, only the last system message, reasoning dropped from replies,
    generation prompt forcing ``<think>\\n``."""

    family = "deepseek-r1-distill"
    drop_reasoning = True
    generation = ASSISTANT + "<think>\n"

    def system_prompt(self, messages: list[dict]) -> str:
        return next((m["content"] for m in reversed(messages) if m["role"] == "system"), "")


class DeepSeekR1Renderer(DeepSeekV3Renderer):
    """R1 (Feb-2025): V3's state machine, but content may precede the calls, the calls are always closed,
    consecutive tool outputs have no separator, reasoning is dropped from replies and generation forces
    ``<think>\\n``."""

    family = "deepseek-r1"
    policy = MessagePolicy(arguments="string")
    drop_reasoning = True
    output_separator = ""
    generation = ASSISTANT + "<think>\n"

    def calls(self, state: _State, message: dict) -> str:
        state.is_tool = False
        out = []
        for call in message["tool_calls"]:
            if not state.is_first:
                out.append(ASSISTANT + message["content"] + CALLS_BEGIN + fenced_call(call))
                state.is_first = True
            else:
                out.append("\n" + fenced_call(call))
        return "".join(out) + CALLS_END + EOS


class DeepSeekV30324Renderer(_DeepSeekRenderer):
    """V3-0324: the user turn already opens the assistant turn; tool-call state is reset for every message, so
    multi-round tool use renders correctly."""

    family = "deepseek-v3-0324"

    def user(self, state: _State, content: str) -> str:
        state.is_tool = False
        state.is_first = False
        state.is_last_user = True
        return USER + content + ASSISTANT

    def assistant_text(self, content: str) -> str:
        return content

    def calls(self, state: _State, message: dict) -> str:
        state.is_last_user = False
        out = [OUTPUTS_END] if state.is_tool else []
        state.is_tool = False
        state.is_output_first = True
        content = self.assistant_text(message["content"])
        for j, call in enumerate(message["tool_calls"]):
            out.append(content + CALLS_BEGIN + fenced_call(call) if j == 0 else "\n" + fenced_call(call))
        return "".join(out) + CALLS_END + EOS

    def reply(self, state: _State, message: dict, kwargs: dict[str, Any]) -> str:
        state.is_last_user = False
        content = self.assistant_text(message["content"])
        if state.is_tool:
            state.is_tool = False
            return OUTPUTS_END + content + EOS
        return content + EOS

    def tool_output(self, state: _State, content: str) -> str:
        state.is_last_user = False
        state.is_tool = True
        if state.is_output_first:
            state.is_output_first = False
            return OUTPUTS_BEGIN + OUTPUT_BEGIN + content + OUTPUT_END
        return "\n" + OUTPUT_BEGIN + content + OUTPUT_END

    def ending(self, state: _State, add_generation_prompt: bool, kwargs: dict[str, Any]) -> str:
        if state.is_tool:
            return OUTPUTS_END
        return ASSISTANT if add_generation_prompt and not state.is_last_user else ""


class DeepSeekR10528Renderer(DeepSeekV30324Renderer):
    """R1-0528: V3-0324's layout with reasoning removed from every assistant message (tool-call turns too)."""

    family = "deepseek-r1-0528"

    def assistant_text(self, content: str) -> str:
        return after_think(content)


class DeepSeekV31Renderer(_DeepSeekRenderer):
    """V3.1 hybrid model. Template kwarg ``thinking`` (default False) picks ``<think>`` or ``</think>`` after the
    final ``<｜Assistant｜>``; history is always rendered in non-thinking form. Calls use ``name<｜tool▁sep｜>args``."""

    family = "deepseek-v3.1"
    call_syntax: CallSyntax = "v3.1"

    def user(self, state: _State, content: str) -> str:
        state.is_tool = False
        state.is_first = False
        state.is_last_user = True
        return USER + content

    def calls(self, state: _State, message: dict) -> str:
        out = [ASSISTANT + "</think>"] if state.is_last_user else []
        state.is_last_user = False
        state.is_tool = False
        for j, call in enumerate(message["tool_calls"]):
            function = call["function"]
            opener = message["content"] + CALLS_BEGIN if j == 0 else ""
            out.append(f"{opener}{CALL_BEGIN}{function['name']}{TOOL_SEP}{function['arguments']}{CALL_END}")
        return "".join(out) + CALLS_END + EOS

    def reply(self, state: _State, message: dict, kwargs: dict[str, Any]) -> str:
        out = ""
        if state.is_last_user:
            # `prefix: true` continues a partial (thinking) answer: the only way history gets `<think>`.
            out = ASSISTANT + ("<think>" if message.get("prefix") and kwargs.get("thinking") else "</think>")
        state.is_last_user = False
        content = message["content"]
        if state.is_tool:
            state.is_tool = False
        elif "</think>" in content:
            content = content.split("</think>", 1)[1]
        return out + content + EOS

    def tool_output(self, state: _State, content: str) -> str:
        state.is_last_user = False
        state.is_tool = True
        return OUTPUT_BEGIN + content + OUTPUT_END

    def ending(self, state: _State, add_generation_prompt: bool, kwargs: dict[str, Any]) -> str:
        if add_generation_prompt and state.is_last_user and not state.is_tool:
            return ASSISTANT + ("<think>" if kwargs.get("thinking") else "</think>")
        return ""
