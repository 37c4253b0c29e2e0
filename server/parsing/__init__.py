"""Tool-call and reasoning parsing of model output, incremental and split-independent.

Entry points: `get_output_parser` (one per request; `feed`/`finish` give neutral deltas, `items` and `result` the output),
`output_constraint` (the grammar that guarantees `tool_choice` and `response_format`), `parse_tool_choice`
(validation), `parse_output` (non-streaming convenience).
"""
from server.parsing.constraint import ConstraintError, output_constraint
from server.parsing.deltas import Delta, OutputItem, ParsedCall, ParsedMessage
from server.parsing.registry import (
    FAMILIES,
    default_thinking,
    get_output_parser,
    new_id_prefix,
    parse_output,
)
from server.parsing.stream import OutputParser
from server.parsing.tool_choice import ToolChoice, parse_tool_choice

__all__ = [
    "ConstraintError",
    "Delta",
    "FAMILIES",
    "OutputItem",
    "OutputParser",
    "ParsedCall",
    "ParsedMessage",
    "ToolChoice",
    "default_thinking",
    "get_output_parser",
    "new_id_prefix",
    "output_constraint",
    "parse_output",
    "parse_tool_choice",
]
