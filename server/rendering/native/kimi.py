"""Native renderer for Kimi's chat template (family ``kimi-k2``: moonshotai/Kimi-K2-Thinking's chat_template.jinja in
the copy llama.cpp keeps, tests/rendering/make_goldens.py says which; the dialect of Kimi-K2 and Kimi Linear).

It reproduces that template byte for byte: the tools first as ``<|im_system|>tool_declare<|im_middle|>JSON<|im_end|>``,
then, unless the conversation opens with a system message, ``<|im_system|>system<|im_middle|>You are Kimi, ...
<|im_end|>``; every message is ``<|im_user|>`` / ``<|im_assistant|>`` / ``<|im_system|>`` (system and tool), its
``name`` or role, ``<|im_middle|>``, its text and ``<|im_end|>``. An assistant turn is ``<think>REASONING</think>``,
its text, then its calls as ``<|tool_calls_section_begin|><|tool_call_begin|>ID<|tool_call_argument_begin|>ARGS
<|tool_call_end|>…<|tool_calls_section_end|>``, with the call's own id (``functions.NAME:IDX`` as the model writes
it, which the parser keeps as the id, so that a re-rendered turn is the model's bytes). The reasoning is kept only
after the last assistant turn without calls (a tool loop keeps it; a final answer drops it from every turn up to
there, which write an empty ``<think></think>``). A tool result is ``## Return of TOOL_CALL_ID⏎TEXT``. The generation
prompt opens the assistant turn; the model writes its ``<think>`` itself.
"""
from __future__ import annotations

from typing import Any

from server.rendering.base import Prepared, Renderer, tojson
from server.rendering.messages import MessagePolicy

SYSTEM, USER, ASSISTANT = "<|im_system|>", "<|im_user|>", "<|im_assistant|>"
MIDDLE, END = "<|im_middle|>", "<|im_end|>"
SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARGUMENT_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
DEFAULT_SYSTEM = "You are Kimi, an AI assistant created by Moonshot AI."
_OPENERS = {"user": USER, "assistant": ASSISTANT}


def render_calls(calls: list[dict]) -> str:
    """One assistant turn's calls, as the template writes them after its text (a missing id renders empty)."""
    out = [SECTION_BEGIN]
    for call in calls:
        arguments = call["function"]["arguments"]
        arguments = arguments if isinstance(arguments, str) else tojson(arguments)
        out.append(f"{CALL_BEGIN}{call.get('id', '')}{ARGUMENT_BEGIN}{arguments}{CALL_END}")
    return "".join(out) + SECTION_END


class KimiRenderer(Renderer):
    """Kimi-K2 / Kimi Linear. The template takes no kwargs."""

    family = "kimi-k2"
    policy = MessagePolicy()  # arguments as given: a string is written verbatim, an object as tojson
    eos_token = END

    def render_prepared(self, prepared: Prepared, add_generation_prompt: bool, kwargs: dict[str, Any]) -> str:
        messages = prepared.messages
        out = [f"{SYSTEM}tool_declare{MIDDLE}{tojson(prepared.tools)}{END}"] if prepared.tools else []
        if messages[0]["role"] != "system":
            out.append(f"{SYSTEM}system{MIDDLE}{DEFAULT_SYSTEM}{END}")
        # reasoning is kept after the last assistant turn without calls only
        history_end = max((i for i, m in enumerate(messages) if m["role"] == "assistant" and not m.get("tool_calls")),
                          default=-1)
        for i, message in enumerate(messages):
            role = message["role"]
            out.append(f"{_OPENERS.get(role, SYSTEM)}{message.get('name') or role}{MIDDLE}")
            if role == "assistant":
                reasoning = message.get("reasoning_content", "") if i > history_end else ""
                out.append(f"<think>{reasoning}</think>{message['content']}")
                if message.get("tool_calls"):
                    out.append(render_calls(message["tool_calls"]))
            elif role == "tool":
                out.append(f"## Return of {message.get('tool_call_id', '')}\n{message['content']}")
            else:
                out.append(message["content"])
            out.append(END)
        if add_generation_prompt:
            out.append(f"{ASSISTANT}assistant{MIDDLE}")
        return "".join(out)
