"""Native renderer for Mistral's instruct format as `mistral-common` encodes Devstral Small 2 / Devstral 2 requests
(family ``devstral``: its ``InstructTokenizerV13`` after ``InstructRequestNormalizerV13``), byte for byte.

- The prompt opens with ``<s>``. A system message is ``[SYSTEM_PROMPT]TEXT[/SYSTEM_PROMPT]`` where it stands.
- The first user message is preceded by ``[AVAILABLE_TOOLS]JSON[/AVAILABLE_TOOLS]`` when there are tools (each tool
  as ``{"type": "function", "function": {"name", "description", "parameters"}}``, one ``json.dumps`` list), and is
  ``[INST]TEXT[/INST]``; consecutive user messages are joined by a blank line, as are consecutive assistants' texts
  (their calls concatenated).
- An assistant message is its text (trailing spaces stripped), then each call as ``[TOOL_CALLS]NAME[ARGS]JSON``
  (arguments re-serialized by ``json.dumps``; empty ones as ``{}``, text that is not JSON as a JSON string), then
  ``</s>``, also when it is the last message. Reasoning is not rendered; an empty assistant message is refused, as
  the encoder refuses it.
- A tool result is ``[TOOL_RESULTS]TEXT[/TOOL_RESULTS]`` (JSON text re-serialized by ``json.dumps``), results of one
  assistant message in the order of its calls.
- There is no generation prompt: the model answers after ``[/INST]`` or ``[/TOOL_RESULTS]``.
"""
from __future__ import annotations

import json
from typing import Any

from server import json_text
from server.rendering.base import Prepared, Renderer
from server.rendering.messages import MessagePolicy

BOS, EOS = "<s>", "</s>"
JOIN = "\n\n"  # mistral-common's CHUNK_JOIN_STR


def normalize_json(text: str) -> str:
    """mistral-common's JSON normalization of arguments and tool results: ``{}`` for nothing, valid JSON
    re-serialized with ``json.dumps`` defaults, anything else as it is (JSON nested past server/json_text.py's
    depth too: never a recursion); NaN or a number past the digit limit is bad input (``ValueError``: a 400)."""
    if not text:
        return "{}"
    try:
        return json.dumps(json_text.loads(text), ensure_ascii=False)
    except json.JSONDecodeError:
        return text


def call_arguments(raw: str) -> str:
    """A call's arguments as the encoder writes them: normalized JSON, or text that is not JSON as a JSON string."""
    text = normalize_json(raw)
    try:
        json_text.loads(text)
    except json.JSONDecodeError:
        return json.dumps(text, ensure_ascii=False)
    return text


def tools_json(tools: list[dict]) -> str:
    return json.dumps([{"type": "function", "function": {
        "name": t["function"]["name"], "description": t["function"].get("description") or "",
        "parameters": t["function"].get("parameters") or {}}} for t in tools], ensure_ascii=False)


def call_text(name: str, arguments: str) -> str:
    """One call as the assistant writes it."""
    return f"[TOOL_CALLS]{name}[ARGS]{arguments}"


def _groups(messages: list[dict]) -> list[tuple[str, list[dict]]]:
    out: list[tuple[str, list[dict]]] = []
    for message in messages:
        if out and out[-1][0] == message["role"]:
            out[-1][1].append(message)
        else:
            out.append((message["role"], [message]))
    return out


class DevstralRenderer(Renderer):
    """Devstral Small 2 (24B) and Devstral 2 (123B): mistral-common's v13 instruct format (tekken tokenizer)."""

    family = "devstral"
    policy = MessagePolicy(arguments="string")
    bos_token = BOS
    eos_token = EOS

    def render_prepared(self, prepared: Prepared, add_generation_prompt: bool, kwargs: dict[str, Any]) -> str:
        tools = prepared.tools
        out = [BOS]
        first_user = True
        call_ids: list[str] = []  # the latest assistant message's calls, which order the results after it
        for role, group in _groups(prepared.messages):
            if role == "system":
                out.extend(f"[SYSTEM_PROMPT]{m['content']}[/SYSTEM_PROMPT]" for m in group)
            elif role == "user":
                if first_user and tools:
                    out.append(f"[AVAILABLE_TOOLS]{tools_json(tools)}[/AVAILABLE_TOOLS]")
                first_user = False
                out.append(f"[INST]{JOIN.join(m['content'] for m in group)}[/INST]")
            elif role == "assistant":
                texts = [m["content"] for m in group if m["content"]]
                calls = [c for m in group for c in m.get("tool_calls") or []]
                call_ids = [c.get("id") or "null" for c in calls]
                if not texts and not calls:
                    raise ValueError("an assistant message needs text or tool calls (mistral-common refuses an empty one)")
                text = JOIN.join(texts).rstrip(" ")
                out.append(text + "".join(call_text(c["function"]["name"], call_arguments(c["function"]["arguments"]))
                                          for c in calls) + EOS)
            else:
                position = {cid: i for i, cid in enumerate(call_ids)}
                ordered = sorted(enumerate(group), key=lambda item: (
                    position.get(item[1].get("tool_call_id") or "null", float("inf")), item[0]))
                out.extend(f"[TOOL_RESULTS]{normalize_json(m['content'])}[/TOOL_RESULTS]" for _, m in ordered)
                call_ids = []
        return "".join(out)
