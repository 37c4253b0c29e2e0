"""Tool-call and reasoning parsing of model output, incremental and split-independent.

Entry points: `get_output_parser` (one per request; `feed`/`finish` give OpenAI deltas, `result` the message),
`tool_call_prompt_suffix` (text to append to the prompt for `tool_choice` "required" or a named function),
`parse_tool_choice` (validation), `parse_output` (non-streaming convenience).
"""
from server.parsing.deltas import ParsedCall, ParsedMessage
from server.parsing.registry import (
    FAMILIES,
    default_thinking,
    get_output_parser,
    new_id_prefix,
    parse_output,
    tool_call_prompt_suffix,
)
from server.parsing.stream import OutputParser
from server.parsing.tool_choice import ToolChoice, parse_tool_choice

__all__ = [
    "FAMILIES",
    "OutputParser",
    "ParsedCall",
    "ParsedMessage",
    "ToolChoice",
    "default_thinking",
    "get_output_parser",
    "new_id_prefix",
    "parse_output",
    "parse_tool_choice",
    "tool_call_prompt_suffix",
]
