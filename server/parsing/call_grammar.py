"""Tool calls as xgrammar structural-tag formats, in each family's own format (the bytes its template renders and its
parser reads), with every call's arguments constrained by its tool's JSON schema.

The result is plain JSON-able dicts (the structural tag's documented wire form): the server never imports xgrammar;
the engine compiles them. `tool_choice` decides the shape:
- `auto`: free text; once the model opens a call (Qwen `<tool_call>`, DeepSeek's call block) it is constrained;
- `required`: one or more calls and nothing else; a named function: exactly one call of it;
- `parallel_tool_calls: false`: at most one call.
"""
from __future__ import annotations

from typing import Any

from engine.json_schema_support import enforceable_schema
from server.parsing.tool_choice import ToolChoice
from server.parsing.tool_stream import ToolFormat

Format = dict[str, Any]  # one xgrammar structural-tag format, as JSON


def tool_schema(tool: dict) -> dict:
    """A tool's parameters schema; a tool without one takes an object of any shape."""
    parameters = (tool.get("function") or {}).get("parameters")
    return parameters if isinstance(parameters, dict) else {"type": "object"}


def json_format(schema: dict | bool, *, style: str = "json") -> Format:
    """A JSON value matching `schema` (`style` "qwen_xml": an object written as Qwen3-Coder parameters).

    String values are not filtered (xgrammar's `excludes` would drop their length limits): the parsers read call
    markup inside a string value as text, and end-of-turn markers are control tokens that no grammar produces."""
    if style == "json":
        # The whitespace between its tokens is the engine's policy (EngineConfig.json_whitespace: none by default).
        return {"type": "json_schema", "json_schema": enforceable_schema(schema), "style": style}
    # Qwen3-Coder values are raw text framed by whitespace the grammar treats as layout (the template writes one
    # newline on each side): one character of it, which the parser strips (qwen3_coder_xml._unframe). DSML
    # parameters are separated by one newline.
    return {"type": "json_schema", "json_schema": schema, "style": style, "max_whitespace_cnt": 1}


def _call(fmt: ToolFormat, tool: dict) -> Format:
    # A format whose arguments are not JSON nor one of xgrammar's styles (Gemma 4's notation) writes its own grammar
    own_arguments = getattr(fmt, "arguments_format", None)
    schema = tool_schema(tool)
    content = own_arguments(schema) if own_arguments else json_format(schema, style=fmt.argument_style)
    own = getattr(fmt, "call_format", None)  # a format whose markup is special tokens (harmony) builds its own
    if own is not None:
        return own(tool["function"]["name"], content)
    begin, end = fmt.call_tag(tool["function"]["name"])
    return {"type": "tag", "begin": begin, "content": content, "end": end}


def _calls(fmt: ToolFormat, tools: list[dict], one: bool) -> Format:
    """One or more calls (exactly one when `one`) and nothing else, inside the family's block if it has one."""
    calls = [_call(fmt, tool) for tool in tools]
    if getattr(fmt, "call_format", None) is not None:  # markup in special tokens: no tags to separate
        either = calls[0] if len(calls) == 1 else {"type": "or", "elements": calls}
        # harmony: a call ends the turn (<|call|>), so one of them; Mistral's and Kimi's are written back to back
        inner = either if one or getattr(fmt, "one_call_per_turn", False) else {"type": "plus", "content": either}
    else:
        inner = calls[0] if one and len(calls) == 1 else {
            "type": "tags_with_separator", "tags": calls, "separator": fmt.call_separator, "at_least_one": True,
            "stop_after_first": one,
        }
    if fmt.block_open and fmt.block_close:
        begin, end = getattr(fmt, "block_format", fmt.block_tag)()
        return {"type": "tag", "begin": begin, "content": inner, "end": end}
    return inner


def required_calls_format(fmt: ToolFormat, tools: list[dict], choice: ToolChoice, parallel: bool) -> Format:
    """`required` (any listed tool) or a named function: the answer is calls only."""
    if choice.mode == "function":
        calls = _calls(fmt, [t for t in tools if t["function"]["name"] == choice.name], one=True)
    else:
        calls = _calls(fmt, tools, one=not parallel)
    if not fmt.calls_prefix:
        return calls
    return {"type": "sequence", "elements": [{"type": "const_string", "value": fmt.calls_prefix}, calls]}


def auto_calls_format(fmt: ToolFormat, tools: list[dict], parallel: bool) -> Format | None:
    """`auto`: free text in which every call the model opens is a valid one; None for a format whose calls open
    with special tokens (harmony, Mistral's), which a text trigger cannot see."""
    if fmt.call_open is None or getattr(fmt, "call_format", None) is not None:
        return None
    if fmt.block_open:  # DeepSeek: one block of calls per turn, opened by its own token
        return {"type": "triggered_tags", "triggers": [fmt.block_open], "tags": [_calls(fmt, tools, one=not parallel)],
                "stop_after_first": True}
    return {"type": "triggered_tags", "triggers": [fmt.call_open], "tags": [_call(fmt, t) for t in tools],
            "stop_after_first": not parallel}
