"""MiniMax-M2 / M2.5 tool calls::

    ⏎<minimax:tool_call>⏎<invoke name="NAME">⏎<parameter name="K">V</parameter>⏎</invoke>⏎</minimax:tool_call>

One block holds a turn's calls back to back. The template writes a string value as it is and any other value as JSON
(`tojson`), so a value is typed by the tool's schema (`param_types.coerce_parameter`: a parameter declared an
integer reads `3` as 3, one declared a string keeps "3"; an undeclared one stays text). The invoke body reads as
DeepSeek's DSML does (formats/dsml.py: a call streams from its `name="…">`, the arguments per completed parameter;
text that breaks the format ends the parameters, a parameter the output cuts off is dropped, a repeated one keeps its
first value), so the arguments are always a JSON object.
"""
from __future__ import annotations

import re

from server.parsing.formats.dsml import DsmlCallParser
from server.parsing.param_types import coerce_parameter, tool_properties

BLOCK_OPEN, BLOCK_CLOSE = "<minimax:tool_call>", "</minimax:tool_call>"
INVOKE_OPEN, INVOKE_CLOSE = "<invoke", "</invoke>"
PARAMETER_OPEN, PARAMETER_CLOSE = "<parameter", "</parameter>"


class MinimaxFormat:
    call_open = INVOKE_OPEN
    call_close = INVOKE_CLOSE
    block_open = BLOCK_OPEN
    block_close = BLOCK_CLOSE
    trims_around_calls = True  # the template writes a newline between the text and the block
    calls_prefix = "\n"  # and that newline when the turn has no text
    call_separator = ""  # each invoke ends with its own newline
    argument_style = "minimax_xml"

    def __init__(self, tools: list[dict] | None):
        self._properties = tool_properties(tools)

    def new_call(self) -> MinimaxCallParser:
        return MinimaxCallParser(self._properties)

    def body_is_open(self, body: str) -> bool:
        # Inside a value (raw text, often code) a closing tag is text.
        return body.count(PARAMETER_OPEN) > body.count(PARAMETER_CLOSE)

    def call_tag(self, name: str) -> tuple[str, str]:
        return f'{INVOKE_OPEN} name="{name}">\n', f"{INVOKE_CLOSE}\n"

    def block_tag(self) -> tuple[str, str]:
        return f"{BLOCK_OPEN}\n", BLOCK_CLOSE


class MinimaxCallParser(DsmlCallParser):
    """One `invoke` body: ` name="NAME">` then `<parameter name="K">V</parameter>` lines."""

    parameter_open = PARAMETER_OPEN
    parameter_close = PARAMETER_CLOSE
    parameter_tag = re.compile(rf'\s*{PARAMETER_OPEN} name="([^"\n]*)">')

    def value(self, tag: re.Match, raw: str) -> object:
        return coerce_parameter(raw, self._properties.get(tag.group(1)))
