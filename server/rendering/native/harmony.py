"""Native renderer for gpt-oss' harmony format (family ``gpt-oss``), byte for byte what OpenAI's `openai-harmony`
library renders for completion (``render_conversation_for_completion`` with its default ``auto_drop_analysis``, no
conversation date: the date would change the prompt's first block every day).

- A system message states the model identity, the knowledge cutoff, ``Reasoning: low|medium|high`` (the template
  kwarg ``reasoning_effort``, default medium) and the valid channels, and that function calls go to ``commentary``
  when the request has tools.
- The first system (or developer) message becomes the developer message's ``# Instructions``; the tools follow as a
  TypeScript ``namespace functions`` (`_typescript`, the library's own rendering of JSON schemas, quirks included).
  Later system messages are developer messages of their own.
- Turns are ``<|start|>ROLE<|message|>TEXT<|end|>``. An assistant turn is its reasoning on ``analysis`` (when the
  last assistant turn is an answer, the reasoning up to the first answer is dropped, as the library drops it), its
  text on ``final`` or, beside calls,
  on ``commentary`` (a preamble), then one message per call:
  ``<|start|>assistant to=functions.NAME<|channel|>commentary <|constrain|>json<|message|>ARGS<|call|>``. A tool
  result is ``<|start|>functions.NAME to=assistant<|channel|>commentary<|message|>TEXT<|end|>``.
- The generation prompt is ``<|start|>assistant``.
"""
from __future__ import annotations

import json
from typing import Any

from server.rendering.base import Prepared, Renderer
from server.rendering.messages import MessagePolicy

REASONING_EFFORTS = ("low", "medium", "high")
IDENTITY = "You are ChatGPT, a large language model trained by OpenAI.\nKnowledge cutoff: 2024-06\n\n"
CHANNELS = "# Valid channels: analysis, commentary, final. Channel must be included for every message."
FUNCTION_CALLS = "\nCalls to these tools must go to the commentary channel: 'functions'."
MAX_SCHEMA_DEPTH = 64  # a deeper parameter schema is refused (a 400), not recursed into


def _default(value: Any, enumerated: bool) -> str:
    """A schema default as the library writes it: an enum's as it is, anything else as compact JSON."""
    return str(value) if enumerated else json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _type(schema: dict, indent: int, depth: int) -> str:
    """The TypeScript type of a property schema whose name sits at ``indent`` spaces, ``depth`` schemas down."""
    if depth > MAX_SCHEMA_DEPTH:
        raise ValueError(f"tools: a parameter schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
    if not isinstance(schema, dict):
        raise ValueError("tools: every parameter schema must be a JSON object")
    kind = schema.get("type")
    if isinstance(kind, list):
        return " | ".join(_type({"type": k}, indent, depth + 1) for k in kind)
    if "oneOf" in schema:  # one variant a line, under the property, each with its description
        lines = [f"{' ' * indent} | {_type(v, indent, depth + 1)}" + (f" // {v['description']}" if v.get("description") else "")
                 for v in schema["oneOf"]]
        return "\n" + "".join(line + "\n" for line in lines) + " " * indent
    if kind == "string":
        return " | ".join(f'"{v}"' for v in schema["enum"]) if "enum" in schema else "string"
    if kind in ("number", "integer"):
        return "number"
    if kind in ("boolean", "null"):
        return kind
    if kind == "array":
        items = schema.get("items")
        return _type(items, indent, depth + 1) + "[]" if isinstance(items, dict) else "Array<any>"
    if kind == "object":
        inner = indent + 4
        described = f"{' ' * inner}// {schema['description']}\n" if schema.get("description") else ""
        return described + "{\n" + _properties(schema, inner, depth + 1) + " " * inner + "}"
    return "any"


def _properties(schema: dict, indent: int, depth: int = 0) -> str:
    """An object schema's properties, one a line (after its description), at ``indent`` spaces."""
    required, pad, out = schema.get("required") or [], " " * indent, []
    properties = schema.get("properties") or {}
    if not isinstance(properties, dict) or not all(isinstance(spec, dict) for spec in properties.values()):
        raise ValueError("tools: properties must map names to JSON schema objects")
    for name, spec in properties.items():
        if spec.get("description"):
            out.append(f"{pad}// {spec['description']}\n")
        typed = _type(spec, indent, depth)
        line = f"{pad}{name}{'' if name in required else '?'}:{'' if typed.startswith(chr(10)) else ' '}{typed},"
        if "default" in spec:
            line += f" // default: {_default(spec['default'], 'enum' in spec)}"
        out.append(line + "\n")
    return "".join(out)


def _typescript(tools: list[dict]) -> str:
    """The tools as the developer message's ``namespace functions``."""
    out = ["## functions\n\nnamespace functions {\n\n"]
    for tool in tools:
        function = tool["function"]
        description = function.get("description") or ""
        out.extend(f"// {line}\n" for line in description.split("\n") if description)
        parameters = function.get("parameters")
        if isinstance(parameters, dict) and parameters.get("type", "object") == "object":
            out.append(f"type {function['name']} = (_: {{\n{_properties(parameters, 0)}}}) => any;\n\n")
        else:
            out.append(f"type {function['name']} = () => any;\n\n")
    out.append("} // namespace functions")
    return "".join(out)


def _message(header: str, text: str, end: str = "<|end|>") -> str:
    return f"<|start|>{header}<|message|>{text}{end}"


def call_header(name: str) -> str:
    """What precedes a call's JSON arguments in a rendered conversation."""
    return f"<|start|>assistant to=functions.{name}<|channel|>commentary <|constrain|>json<|message|>"


class HarmonyRenderer(Renderer):
    """gpt-oss-20b / 120b. Template kwargs: ``reasoning_effort`` (low, medium or high; default medium)."""

    family = "gpt-oss"
    policy = MessagePolicy(arguments="string")
    eos_token = "<|return|>"

    def render_prepared(self, prepared: Prepared, add_generation_prompt: bool, kwargs: dict[str, Any]) -> str:
        messages, tools = prepared.messages, prepared.tools
        effort = kwargs.get("reasoning_effort") or "medium"
        if effort not in REASONING_EFFORTS:
            raise ValueError(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, not {effort!r}")
        out = [_message("system", f"{IDENTITY}Reasoning: {effort}\n\n{CHANNELS}{FUNCTION_CALLS if tools else ''}")]
        first = messages[0]["content"] if messages[0]["role"] == "system" else None
        sections = ([f"# Instructions\n\n{first}"] if first else []) + ([f"# Tools\n\n{_typescript(tools)}"] if tools
                                                                         else [])
        if sections:
            out.append(_message("developer", "\n\n".join(sections)))
        rest = messages[1:] if first is not None else messages
        answers = [i for i, m in enumerate(rest) if m["role"] == "assistant"]
        # The library drops the reasoning up to the first final answer once the last assistant turn is an answer
        finals = [i for i in answers if not rest[i].get("tool_calls")]
        dropped_until = finals[0] if finals and answers[-1] == finals[-1] else -1
        calls: dict[str, str] = {}  # tool_call_id -> function name
        last_call = ""
        for i, message in enumerate(rest):
            role, text = message["role"], message["content"]
            if role == "system":
                out.append(_message("developer", f"# Instructions\n\n{text}"))
            elif role == "user":
                out.append(_message("user", text))
            elif role == "tool":
                name = calls.get(message.get("tool_call_id", ""), message.get("name") or last_call)
                out.append(_message(f"functions.{name} to=assistant<|channel|>commentary", text))
            else:
                reasoning = message.get("reasoning_content")
                if reasoning and i > dropped_until:
                    out.append(_message("assistant<|channel|>analysis", reasoning))
                if not message.get("tool_calls"):
                    out.append(_message("assistant<|channel|>final", text))
                    continue
                if text:
                    out.append(_message("assistant<|channel|>commentary", text))
                for call in message["tool_calls"]:
                    last_call = call["function"]["name"]
                    calls[call.get("id", "")] = last_call
                    out.append(call_header(last_call) + call["function"]["arguments"] + "<|call|>")
        if add_generation_prompt:
            out.append("<|start|>assistant")
        return "".join(out)
