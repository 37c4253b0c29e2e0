"""Native renderer for MiniMax-M2's chat template (family ``minimax-m2``; MiniMaxAI/MiniMax-M2's chat_template.jinja,
whose tool-call format MiniMax-M2.1 / M2.5 keep).

It reproduces the official template byte for byte (tests/rendering/templates/MiniMaxAI-MiniMax-M2.jinja): the prompt
opens ``]~!b[]~b]system⏎`` with the first message's system text (else "You are a helpful assistant."), the tools as
``<tool>JSON</tool>`` lines and an example call; turns are ``]~b]user⏎``, ``]~b]ai⏎`` and ``]~b]tool`` (consecutive
results share one, each ``⏎<response>TEXT</response>``), each closed by ``[e~[⏎``. A later system message is dropped,
as the template drops it. An assistant turn is ``<think>⏎REASONING⏎</think>⏎⏎`` (only after the last user message:
MiniMax's interleaved thinking, kept through a tool loop), its text, then
``⏎<minimax:tool_call>⏎<invoke name="NAME">⏎<parameter name="K">V</parameter>⏎…</invoke>⏎</minimax:tool_call>``
(strings as they are, other values as JSON). The generation prompt opens ``<think>⏎``; a tool result with no call
before it is refused, as the template raises.
"""
from __future__ import annotations

from typing import Any

from server.rendering.base import Prepared, Renderer, tojson
from server.rendering.messages import MessagePolicy

BOS = "]~!b["
ROLE = "]~b]"
END = "[e~["  # ends every turn; MiniMax-M2's eos token
CALLS_OPEN, CALLS_CLOSE = "<minimax:tool_call>", "</minimax:tool_call>"
DEFAULT_SYSTEM = "You are a helpful assistant."
_TOOLS_HEAD = (
    "\n\n# Tools\nYou may call one or more tools to assist with the user query.\n"
    "Here are the tools available in JSONSchema format:\n\n<tools>\n"
)
_TOOLS_TAIL = (
    "</tools>\n\nWhen making tool calls, use XML format to invoke tools and pass parameters:\n\n"
    f'{CALLS_OPEN}\n<invoke name="tool-name-1">\n<parameter name="param-key-1">param-value-1</parameter>\n'
    f'<parameter name="param-key-2">param-value-2</parameter>\n...\n</invoke>\n{CALLS_CLOSE}'
)


def _reasoning_and_content(message: dict) -> tuple[str, str]:
    """(reasoning, content): ``reasoning_content`` if given, else inline ``<think>...</think>`` split off the text."""
    content = message["content"]
    reasoning = message.get("reasoning_content")
    if isinstance(reasoning, str):
        return reasoning, content
    if "</think>" in content:
        return content.split("</think>")[0].strip("\n").split("<think>")[-1].strip("\n"), \
            content.split("</think>")[-1].strip("\n")
    return "", content


def render_calls(calls: list[dict]) -> str:
    """The calls of one assistant turn as the template writes them (after its text)."""
    out = [f"\n{CALLS_OPEN}\n"]
    for call in calls:
        function = call["function"]
        out.append(f'<invoke name="{function["name"]}">\n')
        out.extend(
            f'<parameter name="{key}">{value if isinstance(value, str) else tojson(value)}</parameter>\n'
            for key, value in function["arguments"].items()
        )
        out.append("</invoke>\n")
    return "".join(out) + CALLS_CLOSE


class MinimaxRenderer(Renderer):
    """MiniMax-M2 / M2.1 / M2.5. The template takes no kwargs: it always thinks."""

    family = "minimax-m2"
    # The template iterates `arguments.items()` and concatenates text parts with nothing between them.
    policy = MessagePolicy(arguments="object", text_part_separator="")
    bos_token = BOS
    eos_token = END

    def render_prepared(self, prepared: Prepared, add_generation_prompt: bool, kwargs: dict[str, Any]) -> str:
        messages, tools = prepared.messages, prepared.tools
        system = messages[0]["content"] if messages[0]["role"] == "system" else ""
        turns = messages[1:] if messages[0]["role"] == "system" else messages
        out = [f"{BOS}{ROLE}system\n{system or DEFAULT_SYSTEM}"]
        if tools:
            out.append(_TOOLS_HEAD + "".join(f"<tool>{tojson(tool['function'])}</tool>\n" for tool in tools)
                       + _TOOLS_TAIL)
        out.append(f"{END}\n")
        last_user = max((i for i, m in enumerate(turns) if m["role"] == "user"), default=-1)
        last_call: str | None = None  # the template refuses a tool result unless the last assistant turn called
        for i, message in enumerate(turns):
            role = message["role"]
            if role == "user":
                out.append(f"{ROLE}user\n{message['content']}{END}\n")
            elif role == "assistant":
                reasoning, content = _reasoning_and_content(message)
                out.append(f"{ROLE}ai\n")
                if reasoning and i > last_user:
                    out.append(f"<think>\n{reasoning}\n</think>\n\n")
                out.append(content)
                calls = message.get("tool_calls")
                if calls:
                    out.append(render_calls(calls))
                last_call = calls[-1]["function"]["name"] if calls else None
                out.append(f"{END}\n")
            elif role == "tool":
                if last_call is None:
                    raise ValueError(f"messages: a tool message (turn {i}) must follow an assistant message with "
                                     "tool calls")
                opens = i == 0 or turns[i - 1]["role"] != "tool"
                closes = i == len(turns) - 1 or turns[i + 1]["role"] != "tool"
                out.append(("]~b]tool" if opens else "") + f"\n<response>{message['content']}</response>"
                           + (f"{END}\n" if closes else ""))
        if add_generation_prompt:
            out.append(f"{ROLE}ai\n<think>\n")
        return "".join(out)
