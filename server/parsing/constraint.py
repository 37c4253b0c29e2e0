"""The one grammar that guarantees a request's `tool_choice` and `response_format`, for the engine to enforce.

`output_constraint(family, tools, tool_choice, parallel_tool_calls, response_format, reasoning=...)` is the entry
point for every endpoint (chat completions now; Anthropic messages and Responses map their fields onto these). It
returns an engine `StructuredOutputSpec` (an xgrammar structural tag) or None when the output is free:
- thinking, when the request thinks, stays free text up to its `</think>`; the constraint applies after it;
- `tool_choice` `required` / named: the answer is calls only, in the family's own format, arguments valid against
  their tool's schema; `auto`: free text (or the `response_format` JSON) with every opened call valid; `none`: no call;
- `response_format` `json_object` / `json_schema`: the answer is a JSON value of that schema;
- `structured_outputs` (vLLM's extension: one of `regex`, `grammar` (EBNF), `json` (a schema), `choice`): the whole
  output matches it, thinking included; it cannot be combined with the two above.
Nothing is appended to the prompt: the grammar makes the model write the call opening itself, after any thinking.
`ConstraintError` names the request field at fault (for a 400): a schema that cannot be enforced where a guarantee
was asked for (`required`, a named function, `response_format`); under `auto` such a tool's calls are held to a JSON
object only.
"""
from __future__ import annotations

import json
from typing import Any

from engine.json_schema_support import check_json_schema
from engine.sampling_params import StructuredOutputSpec
from server.parsing.call_grammar import Format, auto_calls_format, json_format, required_calls_format, tool_schema
from server.parsing.registry import Thinking, active_thinking, family_parsing
from server.parsing.tool_choice import ToolChoice, parse_tool_choice


class ConstraintError(ValueError):
    """A request field that cannot be enforced; `param` names it the way the OpenAI error shape does."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def output_constraint(
    family: str,
    tools: list[dict] | None,
    tool_choice: str | dict | None,
    parallel_tool_calls: bool | None,
    response_format: dict | None,
    *,
    reasoning: bool,
    structured_outputs: dict | None = None,
) -> StructuredOutputSpec | None:
    """The constraint for a chat request of template `family` (`tools` as the renderer validated them; `reasoning`:
    thinking is on for this request; `parallel_tool_calls` None means allowed, as OpenAI's default). Raises
    ConstraintError."""
    try:
        choice = parse_tool_choice(tool_choice, tools)
    except ValueError as exc:
        raise ConstraintError("tool_choice", str(exc)) from None
    if structured_outputs is not None:
        if choice.mode in ("required", "function") or response_schema(response_format) is not None:
            raise ConstraintError("structured_outputs", "structured_outputs replaces the grammar of tool_choice "
                                  "'required' or a named function and of response_format: send only one of them")
        return extension_constraint(structured_outputs)
    schema = response_schema(response_format)
    answer = _answer(family, tools or [], choice, parallel_tool_calls is not False, schema)
    if answer is None:
        return None
    thinking = active_thinking(family, reasoning)
    if thinking is not None:
        gap = [{"type": "regex", "pattern": thinking.gap}] if thinking.gap else []
        answer = {"type": "sequence", "elements": [_thinking(thinking), *gap, answer]}
    return _spec(answer)


def completion_constraint(
    response_format: dict | None, structured_outputs: dict | None = None
) -> StructuredOutputSpec | None:
    """The constraint of a text completion (no template, no tools)."""
    schema = response_schema(response_format)
    if structured_outputs is not None:
        if schema is not None:
            raise ConstraintError("structured_outputs", "send either response_format or structured_outputs, not both")
        return extension_constraint(structured_outputs)
    return None if schema is None else _spec(json_format(schema))


def extension_constraint(structured_outputs: Any) -> StructuredOutputSpec:
    """vLLM's `structured_outputs`: exactly one of `regex`, `grammar` (EBNF with a `root` rule), `json` (a schema)
    or `choice` (a list of strings)."""
    given = [key for key in ("regex", "grammar", "json", "choice") if isinstance(structured_outputs, dict)
             and structured_outputs.get(key) is not None]
    if len(given) != 1:
        raise ConstraintError("structured_outputs", "structured_outputs takes exactly one of 'regex', 'grammar', "
                              "'json' or 'choice'")
    key, value = given[0], structured_outputs[given[0]]
    param = f"structured_outputs.{key}"
    if key == "json":
        _check(param, value)
        return _spec(json_format(value))
    if key == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise ConstraintError(param, f"{param} must be a list of non-empty strings")
        return StructuredOutputSpec("ebnf", "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value))
    if not isinstance(value, str) or not value:
        raise ConstraintError(param, f"{param} must be a non-empty string")
    return StructuredOutputSpec("regex" if key == "regex" else "ebnf", value)


def response_schema(response_format: Any) -> dict | bool | None:
    """The JSON schema an OpenAI `response_format` asks for ({"type": "object"} for `json_object`); None for text."""
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind != "json_schema":
        raise ConstraintError("response_format", "response_format.type must be 'text', 'json_object' or 'json_schema'")
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), (dict, bool)):
        raise ConstraintError("response_format.json_schema.schema",
                              "response_format of type 'json_schema' needs json_schema.schema, a JSON schema object")
    _check("response_format.json_schema.schema", spec["schema"])
    return spec["schema"]


def _answer(
    family: str, tools: list[dict], choice: ToolChoice, parallel: bool, schema: dict | bool | None
) -> Format | None:
    content = None if schema is None else json_format(schema)
    if not choice.parses_calls:
        return content
    fmt = family_parsing(family).tool_format(tools)
    if choice.mode != "auto":
        for i, tool in enumerate(tools):
            _check(f"tools[{i}].function.parameters", tool_schema(tool))
        return required_calls_format(fmt, tools, choice, parallel)
    # Under `auto` nobody asked for a guarantee: a tool whose schema cannot be enforced still gets well-formed calls
    # (a JSON object), rather than failing a request that worked without constraints.
    tools = [tool if _enforceable(tool_schema(tool)) else _any_object(tool) for tool in tools]
    if content is None:
        return auto_calls_format(fmt, tools, parallel)
    return {"type": "or", "elements": [content, required_calls_format(fmt, tools, ToolChoice("required"), parallel)]}


def _thinking(thinking: Thinking) -> Format:
    """Free reasoning up to its close (`</think>`; Gemma 4's `<channel|>`): already open when the output starts inside
    it, else optional, unless the model always opens it (Kimi)."""
    opening, closing = thinking.tags
    if thinking.starts_inside:
        return {"type": "tag", "begin": "", "content": {"type": "any_text"}, "end": closing}
    if thinking.model_opens:  # the tags as the one token each is (which the thinking budget counts from)
        return {"type": "tag", "begin": {"type": "token", "token": opening},
                "content": {"type": "any_tokens", "exclude_tokens": [closing]}, "end": {"type": "token", "token": closing}}
    block = {"type": "tag", "begin": opening, "content": {"type": "any_text"}, "end": closing}
    return {"type": "optional", "content": block}


def _enforceable(schema: Any) -> bool:
    try:
        check_json_schema(schema)
    except ValueError:
        return False
    return True


def _any_object(tool: dict) -> dict:
    return {**tool, "function": {**tool["function"], "parameters": {"type": "object"}}}


def _check(param: str, schema: Any) -> None:
    try:
        check_json_schema(schema)
    except ValueError as exc:
        raise ConstraintError(param, f"{param}: {exc}") from None


def _spec(answer: Format) -> StructuredOutputSpec:
    return StructuredOutputSpec("structural_tag", json.dumps({"type": "structural_tag", "format": answer},
                                                              ensure_ascii=False))
