"""Normalization of OpenAI chat messages into the exact shapes a chat template expects.

Clients send many valid variants of the same conversation: content as a string, ``None`` or a list of text parts,
tool-call arguments as a JSON string or an object, ``tool_calls: []`` or ``None``. The official templates each accept
only some of them and crash (or silently drop data) on the others (reference NOTES.md §0.2-0.4 and §4), so every
renderer first maps the request through a :class:`MessagePolicy`. Invalid requests raise ``ValueError``, which the
server turns into a 400.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal
from server import json_text

ROLES = ("system", "user", "assistant", "tool")
# OpenAI's newer "developer" role plays the part of the system prompt for models that only know "system".
_ROLE_ALIASES = {"developer": "system"}
# Names under which clients echo the model's reasoning back (OpenAI-compatible servers disagree on the name).
_REASONING_KEYS = ("reasoning_content", "reasoning")
# Content parts that carry text; anything else (images, audio, files) cannot be shown to a text-only template.
_TEXT_PART_TYPES = ("text", "input_text", "output_text")

ArgumentsForm = Literal["string", "object", "as_given"]


@dataclass(frozen=True)
class MessagePolicy:
    """What one template needs from the messages it renders.

    arguments: the type ``tool_calls[].function.arguments`` must have. ``"string"`` re-serializes objects with the
        template's own ``tojson`` settings; ``"object"`` parses JSON strings (a string that is not a JSON object is
        an error); ``"as_given"`` keeps what the client sent, which lets Qwen3 reproduce the model's exact bytes.
    null_content_with_calls: DeepSeek-V3 (Dec-2024) and R1-Distill only render tool calls when ``content is None``;
        for them the text of an assistant message that carries calls is dropped (the calls matter more to an agent).
    lenient_object_arguments: with ``arguments="object"``, keep a string that is not valid JSON instead of failing
        (Qwen2.5 then ``tojson``-encodes it, which is what the model saw in training for such data).
    text_part_separator: what joins a list of text parts: ``"\\n"`` as vLLM does for templates that take strings only;
        Qwen3.5/3.6's template concatenates the parts itself, with nothing between them.
    extra_roles: roles the template knows beyond system/user/assistant/tool (DeepSeek-V4's ``latest_reminder``).
    kept_fields: message fields passed through to the template unchanged (DeepSeek-V4's quick-instruction ``task``).
    """

    arguments: ArgumentsForm = "as_given"
    null_content_with_calls: bool = False
    lenient_object_arguments: bool = False
    text_part_separator: str = "\n"
    extra_roles: tuple[str, ...] = ()
    kept_fields: tuple[str, ...] = ()


def flatten_content(content: Any, where: str, separator: str = "\n") -> str:
    """Return the text of an OpenAI ``content`` field: a string, ``None`` (empty) or a list of text parts.

    Parts are joined with ``separator``: by default ``"\\n"``, as vLLM does, so the model sees separate parts as
    separate lines.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
                continue
            if not isinstance(part, dict) or part.get("type", "text") not in _TEXT_PART_TYPES:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"{where}: content part of type {kind!r} is not supported; this model takes text only")
            text = part.get("text")
            if not isinstance(text, str):
                raise ValueError(f"{where}: a text content part needs a string 'text' field")
            texts.append(text)
        return separator.join(texts)
    raise ValueError(f"{where}: content must be a string, null or a list of text parts, not {type(content).__name__}")


def _dumps(value: Any) -> str:
    # The templates' `tojson`: json.dumps with ensure_ascii=False and default separators.
    return json.dumps(value, ensure_ascii=False)


def _normalize_arguments(raw: Any, policy: MessagePolicy, where: str) -> Any:
    if raw is None:
        raw = {}
    if not isinstance(raw, (str, dict)):
        raise ValueError(f"{where}: arguments must be a JSON string or an object, not {type(raw).__name__}")
    if policy.arguments == "as_given":
        return raw
    if policy.arguments == "string":
        return raw if isinstance(raw, str) else _dumps(raw)
    if isinstance(raw, dict):
        return raw
    try:
        parsed = json_text.loads(raw) if raw.strip() else {}
    except json.JSONDecodeError as exc:
        if policy.lenient_object_arguments:
            return raw
        raise ValueError(f"{where}: arguments are not valid JSON ({exc.msg})") from None
    if not isinstance(parsed, dict):
        if policy.lenient_object_arguments:
            return raw
        raise ValueError(f"{where}: arguments must encode a JSON object, got {type(parsed).__name__}")
    return parsed


def _normalize_tool_call(call: Any, policy: MessagePolicy, where: str) -> dict:
    if not isinstance(call, dict):
        raise ValueError(f"{where}: a tool call must be an object")
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise ValueError(f"{where}: a tool call needs function.name (a non-empty string)")
    normalized = {
        "type": call.get("type") or "function",
        "function": {
            "name": function["name"],
            "arguments": _normalize_arguments(function.get("arguments"), policy, f"{where}.function.arguments"),
        },
    }
    if call.get("id") is not None:
        normalized["id"] = call["id"]
    return normalized


def _normalize_message(message: Any, index: int, policy: MessagePolicy) -> dict:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise ValueError(f"{where}: a message must be an object")
    role = message.get("role")
    role = _ROLE_ALIASES.get(role, role)
    if role not in ROLES + policy.extra_roles:
        known = ", ".join(ROLES + policy.extra_roles)
        raise ValueError(f"{where}: unsupported role {message.get('role')!r} (expected one of {known})")
    content = flatten_content(message.get("content"), where, policy.text_part_separator)
    out: dict[str, Any] = {"role": role, "content": content}
    if role == "assistant":
        calls = message.get("tool_calls")
        if calls is not None and not isinstance(calls, list):
            raise ValueError(f"{where}: tool_calls must be a list")
        # An empty list must not reach the DeepSeek templates (they drop the content and emit a stray calls-end).
        if calls:
            out["tool_calls"] = [
                _normalize_tool_call(c, policy, f"{where}.tool_calls[{i}]") for i, c in enumerate(calls)
            ]
            if policy.null_content_with_calls:
                out["content"] = None
        reasoning = next((message[k] for k in _REASONING_KEYS if message.get(k) is not None), None)
        if reasoning is not None:
            out["reasoning_content"] = flatten_content(
                reasoning, f"{where}.reasoning_content", policy.text_part_separator
            )
        if message.get("prefix"):
            out["prefix"] = True  # DeepSeek "prefix completion" of a final assistant message
    elif message.get("tool_calls"):
        raise ValueError(f"{where}: only assistant messages can carry tool_calls")
    if role == "tool" and message.get("tool_call_id") is not None:
        out["tool_call_id"] = message["tool_call_id"]
    if isinstance(message.get("name"), str):
        out["name"] = message["name"]
    for key in policy.kept_fields:
        if message.get(key) is not None:
            out[key] = message[key]
    return out


def normalize_messages(messages: Any, policy: MessagePolicy) -> list[dict]:
    """Validate ``messages`` and return fresh dicts in the shape ``policy`` describes (the input is not modified)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    return [_normalize_message(m, i, policy) for i, m in enumerate(messages)]


def normalize_tools(tools: Any) -> list[dict] | None:
    """Validate OpenAI ``tools``; return them unchanged (key order and extra keys are prompt bytes) or None if empty."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ValueError("tools must be a list")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise ValueError(f"tools[{i}]: a tool must be {{'type': 'function', 'function': {{'name': ...}}}}")
        if tool.get("type", "function") != "function":
            raise ValueError(f"tools[{i}]: unsupported tool type {tool.get('type')!r}")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise ValueError(f"tools[{i}]: function.parameters must be a JSON schema object")
    return tools or None
