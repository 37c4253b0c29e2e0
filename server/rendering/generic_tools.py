"""Tools for models whose own Jinja chat template has no tool support at all (SmolLM2's, for one: it reads neither
`tools` nor messages' `tool_calls`): rendered the generic way, as vLLM's and llama.cpp's generic tool templates do
for such models, instead of dropped. A template that knows either is left to render them its own way.

The format is Hermes', the one the `jinja` family's parser reads and its grammar writes (`<tool_call>` JSON), so a
call the model writes is parsed, and re-rendered on the next turn exactly as it was written (the prefix cache hits):
- `tools`: the tool list with the call instructions, at the end of the system message (a system message holding
  only them is added when the conversation has none);
- an assistant message's `tool_calls`: its text, each call as `<tool_call>⏎{"name": ..., "arguments": ...}⏎
  </tool_call>` after the content, joined by `⏎`;
- `tool` messages: one user message per run of results, each as `<tool_response>⏎...⏎</tool_response>`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import jinja2
import jinja2.meta

from server.rendering.base import Prepared

TOOLS_HEAD = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_TAIL = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call>"
)


def tools_text(tools: list[dict]) -> str:
    """The Hermes tool list and call instructions (Qwen2.5's and Qwen3's system prompt carries the same text)."""
    return TOOLS_HEAD + "".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in tools) + TOOLS_TAIL


@dataclass(frozen=True)
class ToolSupport:
    """What a chat template does with tools itself."""

    tools: bool  # it reads the `tools` variable
    calls: bool  # it reads messages' `tool_calls` (and so, presumably, knows `tool` messages)

    @classmethod
    def of(cls, env: jinja2.Environment, source: str) -> ToolSupport:
        return cls("tools" in jinja2.meta.find_undeclared_variables(env.parse(source)), "tool_calls" in source)

    @property
    def none(self) -> bool:
        return not (self.tools or self.calls)


def with_generic_tools(prepared: Prepared, support: ToolSupport) -> Prepared:
    """`prepared` with its tools, calls and results as plain messages, for a template with no tool support at all
    (unchanged for any other)."""
    if not support.none:
        return prepared
    messages, tools = prepared.messages, prepared.tools
    if any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        messages = _calls_as_text(messages)
    if tools:
        if messages and messages[0]["role"] == "system":
            first = messages[0]
            messages = [{**first, "content": f"{first['content']}\n\n{tools_text(tools)}"}, *messages[1:]]
        else:
            messages = [{"role": "system", "content": tools_text(tools)}, *messages]
        tools = None
    return Prepared(messages, tools)


def _calls_as_text(messages: list[dict]) -> list[dict]:
    out: list[dict] = []
    for message in messages:
        if message["role"] == "tool":
            response = f"<tool_response>\n{message['content']}\n</tool_response>"
            if out and out[-1].get("tool_results"):
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + response}
            else:
                out.append({"role": "user", "content": response, "tool_results": True})
        elif message.get("tool_calls"):
            calls = "\n".join(_call_text(call["function"]) for call in message["tool_calls"])
            content = f"{message['content']}\n{calls}" if message.get("content") else calls
            out.append({k: v for k, v in message.items() if k != "tool_calls"} | {"content": content})
        else:
            out.append(message)
    return [{k: v for k, v in m.items() if k != "tool_results"} for m in out]


def _call_text(function: dict) -> str:
    arguments = function["arguments"]
    arguments = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return f'<tool_call>\n{{"name": {json.dumps(function["name"], ensure_ascii=False)}, "arguments": {arguments}}}\n</tool_call>'
