"""Native renderer for Kimi-K3's chat format (family ``kimi-k3``), "XTML": tags written with three special tokens,
``<|open|>TAG ATTR="V"<|sep|>`` … ``<|close|>TAG<|sep|>``, each message followed by ``<|end_of_msg|>``.

Kimi-K3 ships no chat_template.jinja: its format is the Python encoder ``encoding_k3.py`` in moonshotai/Kimi-K3. This
renderer is byte-equal to llama.cpp's Jinja port of it (models/templates/Kimi-K3.jinja, tests/rendering/make_goldens.py
says which) on the golden corpus. In order: the tools as a ``tool-declare`` system message (their JSON with every
object's keys sorted, compact), a ``thinking-effort`` system message when thinking (``thinking_effort``, ``max`` by
default), then the messages: ``<|open|>message role="ROLE"<|sep|>TEXT<|close|>message<|sep|><|end_of_msg|>``. An
assistant turn holds channels: ``think`` (its reasoning, kept in every turn, when thinking is on), ``response`` (its
text) and ``tools``, one ``call tool="NAME" index="N"`` per call with one ``argument key="K" type="T"`` per
argument (a string written as it is, any other value as JSON), or a ``json`` block for arguments that are not a JSON
object. A tool result is ``role="tool" tool="NAME" index="N"``, results answering the last turn's calls by id put in
the calls' order. ``tool_choice`` ``required`` / ``none`` and a ``response_format`` add a system note at the end. The
generation prompt opens the assistant message and its ``think`` channel (``response`` when thinking is off).
"""
from __future__ import annotations

import json
from typing import Any

from server.rendering.base import Prepared, Renderer, tojson
from server.rendering.messages import MessagePolicy

OPEN, CLOSE, SEP, END_OF_MESSAGE = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
EFFORTS = ("low", "medium", "high", "max")
_JSON_ONLY = ("Your response must be raw JSON data without markdown code blocks (```json) or any additional "
              "formatting.")


def escape_attribute(value: Any) -> str:
    return str(value).replace("&", "&amp;").replace('"', "&quot;")


def open_tag(tag: str, attrs: tuple[tuple[str, Any], ...] = ()) -> str:
    return OPEN + tag + "".join(f' {key}="{escape_attribute(value)}"' for key, value in attrs) + SEP


def close_tag(tag: str) -> str:
    return f"{CLOSE}{tag}{SEP}"


def _message(attrs: tuple[tuple[str, Any], ...], body: str) -> str:
    return f"{open_tag('message', attrs)}{body}{close_tag('message')}{END_OF_MESSAGE}"


def _system_note(kind: str, body: str) -> str:
    return _message((("role", "system"), ("type", kind)), body.strip())


def sorted_json(value: Any) -> str:
    """Compact JSON with every object's keys sorted (the template's json_sorted; lists keep their order)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=True)


def xtml_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "object" if isinstance(value, dict) else "array"


def render_arguments(arguments: Any) -> str:
    """A call's arguments: one ``argument`` block per key, or a ``json`` block for text that is not a JSON object."""
    if isinstance(arguments, dict):
        return "".join(
            f"{open_tag('argument', (('key', key), ('type', xtml_type(value))))}"
            f"{value if isinstance(value, str) else tojson(value)}{close_tag('argument')}"
            for key, value in arguments.items()
        )
    if isinstance(arguments, str) and arguments.strip():
        return f"{open_tag('json', (('type', 'object'),))}{arguments}{close_tag('json')}"
    return ""


def render_calls(calls: list[dict]) -> str:
    out = [open_tag("tools")]
    for index, call in enumerate(calls, start=1):
        function = call["function"]
        out.append(f"{open_tag('call', (('tool', function['name']), ('index', index)))}"
                   f"{render_arguments(function.get('arguments', {}))}{close_tag('call')}")
    return "".join(out) + close_tag("tools")


def _named(role: str, message: dict) -> tuple[tuple[str, Any], ...]:
    return (("role", role), ("name", message["name"])) if message.get("name") else (("role", role),)


class KimiK3Renderer(Renderer):
    """Kimi-K3. Template kwargs: ``thinking`` (default true), ``thinking_effort`` (low/medium/high/max, default max),
    ``tool_choice`` and ``response_format`` (their system notes)."""

    family = "kimi-k3"
    # Arguments as objects, as encoding_k3 parses a JSON string; text that is not a JSON object stays a json block.
    # A list of text parts is written part after part, with nothing between them, as the encoder writes it.
    policy = MessagePolicy(arguments="object", lenient_object_arguments=True, text_part_separator="")
    eos_token = END_OF_MESSAGE

    def render_prepared(self, prepared: Prepared, add_generation_prompt: bool, kwargs: dict[str, Any]) -> str:
        thinking = kwargs.get("thinking", True)
        effort = kwargs.get("thinking_effort", "max")
        if thinking and effort is not None and effort not in EFFORTS:
            raise ValueError(f"Unsupported thinking_effort={effort}; supported values are low, medium, high, and max.")
        out = []
        if prepared.tools:
            out.append(_system_note("tool-declare", "# Tools\nHere are the available tools, described in JSONSchema."
                                    f"\n\n```json\n{sorted_json(prepared.tools)}\n```"))
        if thinking and effort in EFFORTS:
            out.append(_system_note("thinking-effort", "`thinking_effort` guides on how much to think in your thinking "
                                    "channel (not including the response channel), supported values include `low`, "
                                    f"`medium`, `high`, and `max`.\nNow the system is invoked with `thinking_effort={effort}`."))
        messages = prepared.messages
        calls: list[dict] | None = None
        answered = 0  # tool results since the last assistant turn (the template's numbering)
        i = 0
        while i < len(messages):
            message = messages[i]
            role = message["role"]
            if role == "tool":
                end = next((j for j in range(i, len(messages)) if messages[j]["role"] != "tool"), len(messages))
                out.append(_tool_results(messages[i:end], calls, answered))
                answered, i = answered + end - i, end
                continue
            if role == "assistant":
                calls, answered = message.get("tool_calls"), 0
                out.append(_message(_named(role, message), _assistant(message, thinking)))
            else:
                out.append(_message(_named(role, message), message["content"]))
            i += 1
        out += _notes(kwargs)
        if add_generation_prompt:
            out.append(open_tag("message", (("role", "assistant"),)) + open_tag("think" if thinking else "response"))
        return "".join(out)


def _assistant(message: dict, thinking: Any) -> str:
    out = []
    if thinking:
        reasoning = message.get("reasoning_content") or ""
        out.append(f"{open_tag('think')}{reasoning if reasoning.strip() else ''}{close_tag('think')}")
    out.append(f"{open_tag('response')}{message['content']}{close_tag('response')}")
    if message.get("tool_calls"):
        out.append(render_calls(message["tool_calls"]))
    return "".join(out)


def _tool_results(run: list[dict], calls: list[dict] | None, answered: int) -> str:
    """A run of tool results: in the calls' order when each answers one of the last turn's calls by id, else as sent;
    each named by its call (else its own ``name``, else the call at its position) and numbered on from ``answered``."""
    ids = [str(call["id"]) for call in calls or [] if call.get("id") is not None]
    if all(m.get("tool_call_id") is not None and str(m["tool_call_id"]) in ids for m in run):
        ordered = []
        for call in calls or []:
            if call.get("id") is not None and not any(str(call["id"]) == str(c.get("id")) for c, _ in ordered):
                ordered += [(call, m) for m in run if str(m["tool_call_id"]) == str(call["id"])]
        named = [(m, call["function"]["name"]) for call, m in ordered]
    else:
        named = [(m, m.get("name")) for m in run]
    out = []
    for index, (message, name) in enumerate(named, start=answered + 1):
        if name is None and calls and index <= len(calls):
            name = calls[index - 1]["function"]["name"]
        if name is None:
            raise ValueError("Kimi K3 tool messages need a resolvable tool name: carry `name`, or match a preceding "
                             "assistant tool_call by order")
        out.append(_message((("role", "tool"), ("tool", name), ("index", index)), message["content"]))
    return "".join(out)


def _notes(kwargs: dict[str, Any]) -> list[str]:
    """The system notes after the conversation: the request's tool_choice and response_format."""
    out = []
    choice = kwargs.get("tool_choice")
    if choice in ("required", "none"):
        must = "call tools" if choice == "required" else "NOT call any tools"
        out.append(_system_note("tool-choice", f"The system is invoked with `tool_choice={choice}`.\n"
                                f"You MUST {must} in the next message."))
    response_format = kwargs.get("response_format")
    kind = response_format.get("type") if isinstance(response_format, dict) else response_format
    if kind == "json_object":
        out.append(_system_note("response-format", f"The system is invoked with `response_format=json_object`.\n"
                                f"{_JSON_ONLY}"))
    elif kind == "json_schema":
        out.append(_system_note("response-format", f"The system is invoked with `response_format=json_schema`.\n"
                                f"{_JSON_ONLY}\nThe JSON data must match the following schema:\n```json\n"
                                f"{sorted_json(_response_schema(kwargs))}\n```"))
    return out


def _response_schema(kwargs: dict[str, Any]) -> Any:
    if "response_schema" in kwargs:
        return kwargs["response_schema"]
    wrapper = kwargs["response_format"].get("json_schema") if isinstance(kwargs["response_format"], dict) else None
    if isinstance(wrapper, dict):
        return wrapper.get("schema", wrapper.get("json_schema", wrapper))
    return wrapper
