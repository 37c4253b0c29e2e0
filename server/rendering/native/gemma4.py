"""Native renderer for Gemma 4's chat template (family ``gemma4``; chat_template.jinja of google/gemma-4-31B-it).

It reproduces the official template byte for byte (tests/rendering/templates/google-gemma-4-31B-it.jinja):
``<bos>``; a system turn ``<|turn>system⏎`` when thinking is on (``<|think|>`` first), tools are given or the first
message is a system one (its text trimmed, then one ``<|tool>declaration:NAME{...}<tool|>`` per tool); then
``<|turn>ROLE⏎`` per message (the assistant's role written ``model``), its calls as
``<|tool_call>call:NAME{key:value,...}<tool_call|>``, its tool results as
``<|tool_response>response:NAME{value:...}<tool_response|>``, its text (a model's with any ``<|channel>...<channel|>``
thought removed, every text trimmed) and ``<turn|>⏎`` — except after results with no text, where the model's turn
goes on. The generation prompt is ``<|turn>model⏎`` (not after results), then ``<|channel>thought⏎<channel|>``
(an empty thought) unless ``enable_thinking``. The template reads no effort: thinking is on or off.

Values use Gemma's own notation, not JSON: strings between ``<|"|>`` quotes, keys sorted case-insensitively (Jinja's
``dictsort``), call arguments' keys bare. ``prepare`` attaches each ``tool`` message to the assistant message whose
calls it answers, as ``tool_responses`` (Google's form; the template has no other place for results beside a
``<|turn>tool`` turn, which a result with no call before it still gets).
"""
from __future__ import annotations

from typing import Any

from server.rendering.base import Prepared, Renderer
from server.rendering.messages import MessagePolicy

QUOTE = '<|"|>'
_STANDARD_KEYS = ("description", "type", "properties", "required", "nullable")
_MISSING = object()


def _get(value: Any, key: str) -> Any:
    """Jinja's ``value[key]``: missing (undefined) for a non-mapping or an absent key."""
    return value.get(key, _MISSING) if isinstance(value, dict) else _MISSING


def _text(value: Any) -> str:
    return "" if value is _MISSING else str(value)


def _truthy(value: Any) -> bool:
    return value is not _MISSING and bool(value)


def _sorted_items(mapping: dict) -> list[tuple[Any, Any]]:
    """Jinja's ``dictsort``: by key, strings compared lower-cased."""
    return sorted(mapping.items(), key=lambda kv: kv[0].lower() if isinstance(kv[0], str) else kv[0])


def format_argument(value: Any, escape_keys: bool = True) -> str:
    """A value in Gemma's notation: quoted strings, ``true``/``false``, ``{k:v}`` with sorted keys, ``[a,b]``."""
    if isinstance(value, str):
        return QUOTE + value + QUOTE
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        parts = [(QUOTE + str(k) + QUOTE if escape_keys else str(k)) + ":" + format_argument(v, escape_keys)
                 for k, v in _sorted_items(value)]
        return "{" + ",".join(parts) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(format_argument(v, escape_keys) for v in value) + "]"
    return str(value)


def _quoted_list(items: Any) -> str:
    return ",".join(QUOTE + str(item) + QUOTE for item in items)


def _comma(state: list[bool]) -> str:
    """The template's ``add_comma`` dance: a comma before every field but the first one written."""
    if state[0]:
        return ","
    state[0] = True
    return ""


def _array_items(items: dict, value: dict) -> str:
    fields = []
    for key, item in _sorted_items(items):
        if item is None:
            continue
        if key == "properties":
            inner = format_parameters(item, _get(value["items"], "required") or []) if isinstance(item, dict) else ""
            fields.append("properties:{" + inner + "}")
        elif key == "required":
            fields.append("required:[" + _quoted_list(item) + "]")
        elif key == "type":
            upper = item.upper() if isinstance(item, str) else [str(t).upper() for t in item]
            fields.append("type:" + format_argument(upper))
        else:
            fields.append(f"{key}:" + format_argument(item))
    return ",items:{" + ",".join(fields) + "}"


def format_parameters(properties: dict, required: Any) -> str:
    """The template's ``format_parameters``: each non-standard key's schema in Gemma's declaration notation."""
    out = []
    for key, value in _sorted_items(properties):
        if key in _STANDARD_KEYS:
            continue
        state = [False]
        field = f"{key}:{{"
        description = _get(value, "description")
        if _truthy(description):
            field += f"description:{QUOTE}{description}{QUOTE}"
            state[0] = True
        if _truthy(_get(value, "nullable")):
            field += _comma(state) + "nullable:true"
        kind = _text(_get(value, "type")).upper()
        if kind == "STRING":
            if _truthy(_get(value, "enum")):
                field += _comma(state) + "enum:" + format_argument(value["enum"])
        elif kind == "OBJECT":
            nested = _get(value, "properties")
            source = nested if isinstance(nested, dict) else value
            field += ",properties:{" + format_parameters(source, _get(value, "required") or []) + "}"
            if _truthy(_get(value, "required")):
                field += ",required:[" + _quoted_list(value["required"]) + "]"
        elif kind == "ARRAY":
            items = _get(value, "items")
            if isinstance(items, dict) and items:
                field += _array_items(items, value)
        out.append(field + _comma(state) + f"type:{QUOTE}{kind}{QUOTE}}}")
    return ",".join(out)


def format_declaration(function: dict) -> str:
    """``declaration:NAME{description:...,parameters:{...}}`` as the template writes one tool."""
    out = f"declaration:{function['name']}{{description:{QUOTE}{_text(function.get('description', _MISSING))}{QUOTE}"
    params = function.get("parameters")
    if params:
        out += ",parameters:{"
        if params.get("properties"):
            out += "properties:{" + format_parameters(params["properties"], params.get("required")) + "},"
        if params.get("required"):
            out += "required:[" + _quoted_list(params["required"]) + "],"
        if params.get("type"):
            out += f"type:{QUOTE}{str(params['type']).upper()}{QUOTE}}}"
    if "response" in function:
        response = function["response"]
        out += ",response:{"
        if _truthy(_get(response, "description")):
            out += f"description:{QUOTE}{response['description']}{QUOTE},"
        if _text(_get(response, "type")).upper() == "OBJECT":
            out += f"type:{QUOTE}OBJECT{QUOTE}}}"
    return (out + "}").strip()


def call_text(function: dict) -> str:
    """One call as the model writes it: ``<|tool_call>call:NAME{key:value,...}<tool_call|>``."""
    arguments = function["arguments"]
    if isinstance(arguments, dict):
        body = ",".join(f"{k}:" + format_argument(v, escape_keys=False) for k, v in _sorted_items(arguments))
    else:
        body = arguments if isinstance(arguments, str) else ""
    return f"<|tool_call>call:{function['name']}{{{body}}}<tool_call|>"


def response_text(name: str, response: Any) -> str:
    if isinstance(response, dict):
        body = ",".join(f"{k}:" + format_argument(v, escape_keys=False) for k, v in _sorted_items(response))
        return f"<|tool_response>response:{name}{{{body}}}<tool_response|>"
    return f"<|tool_response>response:{name}{{value:{format_argument(response, escape_keys=False)}}}<tool_response|>"


def strip_thinking(text: str) -> str:
    """A model turn's text without its ``<|channel>...<channel|>`` thoughts, trimmed."""
    kept = [part.split("<|channel>")[0] if "<|channel>" in part else part for part in text.split("<channel|>")]
    return "".join(kept).strip()


def thinking_on(kwargs: dict[str, Any]) -> bool:
    return bool(kwargs.get("enable_thinking"))


class Gemma4Renderer(Renderer):
    """Gemma 4 (31B, 26B-A4B, E2B/E4B instruction-tuned). Template kwarg: ``enable_thinking``."""

    family = "gemma4"
    # The template writes a mapping in its notation and a string as it is: JSON objects are parsed, other strings kept
    policy = MessagePolicy(arguments="object", lenient_object_arguments=True)
    bos_token = "<bos>"
    eos_token = "<eos>"

    def prepare(self, messages: list[dict], tools: list[dict] | None = None) -> Prepared:
        prepared = super().prepare(messages, tools)
        out: list[dict] = []
        for message in prepared.messages:
            caller = out[-1] if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") else None
            if message["role"] != "tool" or caller is None:
                out.append(message)
                continue
            names = {call.get("id"): call["function"]["name"] for call in caller["tool_calls"]}
            name = names.get(message.get("tool_call_id"), message.get("name", "unknown"))
            response = {"name": name, "response": message["content"]}
            out[-1] = {**caller, "tool_responses": [*caller.get("tool_responses", []), response]}
        return Prepared(out, prepared.tools)

    def render_prepared(self, prepared: Prepared, add_generation_prompt: bool, kwargs: dict[str, Any]) -> str:
        messages, tools = prepared.messages, prepared.tools
        thinking = thinking_on(kwargs)
        out = [self.bos_token]
        if thinking or tools or messages[0]["role"] == "system":
            out.append("<|turn>system\n" + ("<|think|>" if thinking else ""))
            if messages[0]["role"] == "system":
                out.append(messages[0]["content"].strip())
                messages = messages[1:]
            out.extend(f"<|tool>{format_declaration(tool['function'])}<tool|>" for tool in tools or ())
            out.append("<turn|>\n")
        last_kind = None
        for message in messages:
            role = "model" if message["role"] == "assistant" else message["role"]
            out.append(f"<|turn>{role}\n")
            last_kind = None
            if message.get("tool_calls"):
                out.extend(call_text(call["function"]) for call in message["tool_calls"])
                last_kind = "tool_call"
            responses = message.get("tool_responses")
            if responses:
                out.extend(response_text(r["name"], r["response"]) for r in responses)
                last_kind = "tool_response"
            content = message["content"]
            out.append(strip_thinking(content) if role == "model" else content.strip())
            if not (responses and not content):
                out.append("<turn|>\n")
        if add_generation_prompt:
            if last_kind != "tool_response":
                out.append("<|turn>model\n")
            if not kwargs.get("enable_thinking", False):
                out.append("<|channel>thought\n<channel|>")
        return "".join(out)
