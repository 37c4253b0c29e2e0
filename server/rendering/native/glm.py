"""Native renderer for the GLM-4.7 chat template (family ``glm-4.7``; zai-org/GLM-4.7-Flash's chat_template.jinja).

It reproduces the official template byte for byte (tests/rendering/templates/zai-org-GLM-4.7-Flash.jinja): the prompt
opens ``[gMASK]<sop>``; tools are listed as JSON in a ``<|system|>`` block; turns are ``<|user|>``, ``<|system|>``,
``<|assistant|>`` and ``<|observation|>`` (consecutive tool results share one) with no separators; an assistant turn
is ``<think>REASONING</think>`` (or a bare ``</think>``), its trimmed text, then its calls as
``<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>…</tool_call>`` (strings as they are, other values as
JSON). Past reasoning is kept after the last user message, and everywhere when ``clear_thinking`` is passed false
(GLM's "preserved thinking", which the server sets so that an agent's turns extend each other). The generation
prompt opens ``<think>``, or closes it at once with ``enable_thinking=False``.
"""
from __future__ import annotations

from typing import Any

from server.rendering.base import Prepared, Renderer, tojson
from server.rendering.messages import MessagePolicy

PROMPT_HEAD = "[gMASK]<sop>"
_TOOLS_HEAD = (
    "<|system|>\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
)
_TOOLS_TAIL = (
    "</tools>\n\nFor each function call, output the function name and arguments within the following XML format:\n"
    "<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value><arg_key>"
    "{arg-key-2}</arg_key><arg_value>{arg-value-2}</arg_value>...</tool_call>"
)


def _reasoning_and_content(message: dict) -> tuple[str, str]:
    """(reasoning, content): ``reasoning_content`` if given, else inline ``<think>...</think>`` split off the text."""
    content = message["content"]
    reasoning = message.get("reasoning_content")
    if isinstance(reasoning, str):
        return reasoning, content
    if "</think>" in content:
        reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
        return reasoning, content.split("</think>")[-1].lstrip("\n")
    return "", content


def _tool_calls(calls: list[dict]) -> str:
    out = []
    for call in calls:
        function = call["function"]
        out.append(f"<tool_call>{function['name']}")
        out.extend(
            f"<arg_key>{key}</arg_key><arg_value>{value if isinstance(value, str) else tojson(value)}</arg_value>"
            for key, value in function["arguments"].items()
        )
        out.append("</tool_call>")
    return "".join(out)


class GlmRenderer(Renderer):
    """GLM-4.7 / GLM-4.7-Flash. Template kwargs: ``enable_thinking`` (only a false value turns thinking off) and
    ``clear_thinking`` (a false value keeps the reasoning of every past turn)."""

    family = "glm-4.7"
    # The template iterates `arguments.items()` and concatenates text parts with nothing between them.
    policy = MessagePolicy(arguments="object", text_part_separator="")
    eos_token = "<|endoftext|>"
    keeps_reasoning_kwarg = "clear_thinking"
    keeps_reasoning_value = False

    def render_prepared(self, prepared: Prepared, add_generation_prompt: bool, kwargs: dict[str, Any]) -> str:
        messages, tools = prepared.messages, prepared.tools
        out = [PROMPT_HEAD]
        if tools:
            out.append(_TOOLS_HEAD + "".join(tojson(tool) + "\n" for tool in tools) + _TOOLS_TAIL)
        last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
        keep_all = "clear_thinking" in kwargs and not kwargs["clear_thinking"]
        for i, message in enumerate(messages):
            role = message["role"]
            if role == "user":
                out.append("<|user|>" + message["content"])
            elif role == "system":
                out.append("<|system|>" + message["content"])
            elif role == "tool":
                opens = i == 0 or messages[i - 1]["role"] != "tool"
                response = f"<tool_response>{message['content']}</tool_response>"
                out.append(("<|observation|>" if opens else "") + response)
            elif role == "assistant":
                reasoning, content = _reasoning_and_content(message)
                kept = (keep_all or i > last_user) and reasoning
                out.append("<|assistant|>" + (f"<think>{reasoning.strip()}</think>" if kept else "</think>"))
                out.append(content.strip() + _tool_calls(message.get("tool_calls", [])))
        if add_generation_prompt:
            out.append("<|assistant|>" + ("</think>" if _thinking_off(kwargs) else "<think>"))
        return "".join(out)


def _thinking_off(kwargs: dict[str, Any]) -> bool:
    """The template's ``enable_thinking is defined and not enable_thinking``."""
    return "enable_thinking" in kwargs and not kwargs["enable_thinking"]
