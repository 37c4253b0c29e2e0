"""Tool descriptions for DeepSeek models, whose official chat templates ignore ``tools=``.

Where they go: the DeepSeek-V3.1 model card defines a ``## Tools`` block that follows the system prompt, separated
by a blank line (``{system prompt}\\n\\n{tool_description}``); its wording here is the one vLLM ships in
``tool_chat_template_deepseekv31.jinja``. The older families (V3, V3-0324, R1, R1-0528, R1-Distill) document no
block of their own, so they get the same block with the call format line written in *their* call syntax (the
``function<｜tool▁sep｜>name`` + fenced JSON form their templates render in history). Without a system message the block
becomes the whole system prompt (no leading blank line). The block is merged into the last system message, so
R1-Distill (which keeps only the last system message) and the families that join all system messages see the same
``system + "\\n\\n" + tools`` text.
"""
from __future__ import annotations

import json
from typing import Literal

CallSyntax = Literal["fenced", "v3.1"]

_FORMAT_LINE = {
    "v3.1": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>tool_call_name<｜tool▁sep｜>tool_call_arguments<｜tool▁call▁end｜>"
    "{{additional_tool_calls}}<｜tool▁calls▁end｜>",
    "fenced": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>tool_call_name\n```json\n"
    "tool_call_arguments\n```<｜tool▁call▁end｜>{{additional_tool_calls}}<｜tool▁calls▁end｜>",
}
_CHAINING_RULE = {
    "v3.1": "- For multiple tool calls, chain them directly without separators or spaces\n",
    "fenced": "- For multiple tool calls, separate them with a single newline\n",
}


def tool_block(tools: list[dict], syntax: CallSyntax) -> str:
    """The ``## Tools`` text for ``tools`` (validated OpenAI tools), in the given call syntax."""
    out = ["## Tools\nYou have access to the following tools:\n"]
    for tool in tools:
        function = tool["function"]
        parameters = json.dumps(function.get("parameters") or {}, ensure_ascii=False)
        out.append(
            f"\n### {function['name']}\nDescription: {function.get('description') or ''}\n\nParameters: {parameters}\n"
        )
    out.append(
        "\nIMPORTANT: ALWAYS adhere to this exact format for tool use:\n"
        + _FORMAT_LINE[syntax]
        + "\n\nWhere:\n\n- `tool_call_name` must be an exact match to one of the available tools\n"
        "- `tool_call_arguments` must be valid JSON that strictly follows the tool's Parameters Schema\n"
        + _CHAINING_RULE[syntax]
    )
    return "".join(out)


def with_tool_system_prompt(messages: list[dict], block: str) -> list[dict]:
    """Append ``block`` to the last system message (or insert one at the top); returns a new list."""
    last_system = max((i for i, m in enumerate(messages) if m["role"] == "system"), default=None)
    if last_system is None:
        return [{"role": "system", "content": block}, *messages]
    merged = dict(messages[last_system])
    merged["content"] = f"{merged['content']}\n\n{block}"
    return [*messages[:last_system], merged, *messages[last_system + 1 :]]
