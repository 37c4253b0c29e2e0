"""Native renderer for the Qwen3.5 / Qwen3.6 chat template (family ``qwen3.6``; Qwen/Qwen3.6-27B's template).

It reproduces the official template byte for byte (tests/rendering/templates/Qwen-Qwen3.6-27B.jinja): the
Qwen3-Coder XML tool format (tools listed as JSON, calls as ``<function=..><parameter=..>``), every message's text
trimmed, the generation prompt opening ``<think>\\n`` (closed and empty with ``enable_thinking=False``), and past
reasoning kept only after the last user query unless ``preserve_thinking=True`` keeps all of it. The template refuses
what it cannot render (no user query, a system message after the first), which surfaces here as ``ValueError``.
"""
from __future__ import annotations

from typing import Any

from server.rendering.base import Prepared, Renderer, tojson
from server.rendering.messages import MessagePolicy
from server.rendering.native.qwen import (
    CODER_TOOLS_TAIL,
    IM_END,
    IM_START,
    generation_prompt,
    is_tool_response_text,
)

_TOOLS_HEAD = "# Tools\n\nYou have access to the following functions:\n\n<tools>"


def _last_query_index(messages: list[dict]) -> int:
    """The last user message that is not a hand-written tool response; the template refuses a chat without one."""
    for index in range(len(messages) - 1, -1, -1):
        message = messages[index]
        if message["role"] == "user" and not is_tool_response_text(message["content"].strip()):
            return index
    raise ValueError("messages: no user query found (this template needs at least one user message)")


def _reasoning_and_content(message: dict, content: str) -> tuple[str, str]:
    """(reasoning, content): ``reasoning_content`` if given, else inline ``<think>...</think>`` split off the text."""
    reasoning = message.get("reasoning_content")
    if not isinstance(reasoning, str):
        reasoning = ""
        if "</think>" in content:
            reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
            content = content.split("</think>")[-1].lstrip("\n")
    return reasoning.strip(), content


def _parameter_value(value: Any) -> str:
    return value if isinstance(value, str) else tojson(value)


def _tool_calls(calls: list[dict], content: str) -> str:
    out = []
    for j, call in enumerate(calls):
        function = call["function"]
        opening = "\n" if j else ("\n\n" if content.strip() else "")
        out.append(f"{opening}<tool_call>\n<function={function['name']}>\n")
        out.extend(
            f"<parameter={name}>\n{_parameter_value(value)}\n</parameter>\n"
            for name, value in function["arguments"].items()
        )
        out.append("</function>\n</tool_call>")
    return "".join(out)


class Qwen36Renderer(Renderer):
    """Qwen3.5 / Qwen3.6. Template kwargs: ``enable_thinking`` (only an explicit ``False`` turns thinking off) and
    ``preserve_thinking`` (only ``True`` keeps reasoning before the last user query)."""

    family = "qwen3.6"
    # The template iterates `arguments|items`; text parts are joined with nothing between them.
    policy = MessagePolicy(arguments="object", text_part_separator="")
    eos_token = IM_END
    refuses_late_system_messages = True
    keeps_reasoning_kwarg = "preserve_thinking"

    def render_prepared(self, prepared: Prepared, add_generation_prompt: bool, kwargs: dict[str, Any]) -> str:
        messages, tools = prepared.messages, prepared.tools
        system = messages[0]["content"].strip() if messages[0]["role"] == "system" else None
        out = []
        if tools:
            out.append(f"{IM_START}system\n{_TOOLS_HEAD}")
            out.extend("\n" + tojson(tool) for tool in tools)
            out.append(CODER_TOOLS_TAIL + (f"\n\n{system}" if system else "") + f"{IM_END}\n")
        elif system is not None:
            out.append(f"{IM_START}system\n{system}{IM_END}\n")
        last_query = _last_query_index(messages)
        keep_all_reasoning = kwargs.get("preserve_thinking") is True
        last = len(messages) - 1
        for i, message in enumerate(messages):
            role, content = message["role"], message["content"].strip()
            if role == "system":
                if i > 0:
                    raise ValueError(f"messages[{i}]: this template takes a system message only at the beginning")
            elif role == "user":
                out.append(f"{IM_START}user\n{content}{IM_END}\n")
            elif role == "assistant":
                reasoning, content = _reasoning_and_content(message, content)
                if keep_all_reasoning or i > last_query:
                    out.append(f"{IM_START}assistant\n<think>\n{reasoning}\n</think>\n\n{content}")
                else:
                    out.append(f"{IM_START}assistant\n{content}")
                out.append(_tool_calls(message.get("tool_calls", []), content) + f"{IM_END}\n")
            else:  # tool: consecutive results share one user turn, opened after any other message
                opens = i > 0 and messages[i - 1]["role"] != "tool"
                closes = i == last or messages[i + 1]["role"] != "tool"
                out.append(
                    (f"{IM_START}user" if opens else "")
                    + f"\n<tool_response>\n{content}\n</tool_response>"
                    + (f"{IM_END}\n" if closes else "")
                )
        out.append(generation_prompt(add_generation_prompt))
        if add_generation_prompt:
            out.append("<think>\n\n</think>\n\n" if kwargs.get("enable_thinking", True) is False else "<think>\n")
        return "".join(out)
