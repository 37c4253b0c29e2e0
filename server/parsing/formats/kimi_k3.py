"""Kimi-K3's tool calls, in its XTML ``tools`` channel after the ``response`` one::

    <|open|>tools<|sep|><|open|>call tool="NAME" index="1"<|sep|>
    <|open|>argument key="K" type="string"<|sep|>V<|close|>argument<|sep|>…<|close|>call<|sep|>…<|close|>tools<|sep|>

(written back to back). Each argument carries its type: a ``string`` value is raw text, any other is JSON (kept as text
when it does not parse, as vLLM's kimi_k3 parser does), so no schema is needed; attribute values are escaped
(``&amp;``, ``&quot;``) and read back. An invoke body reads as DeepSeek's DSML does (formats/dsml.py: a call streams
from its head, the arguments per completed argument, text that breaks the format ends them, one the output cuts off is
dropped), so the arguments are always a JSON object. The channel tags around the answer are not content
(``RESPONSE_TAGS``, dropped by the output parser) and ``<|close|>message<|sep|>`` ends the turn.
"""
from __future__ import annotations

import re

from server import json_text
from server.parsing.formats.dsml import DsmlCallParser
from server.rendering.native.kimi_k3 import END_OF_MESSAGE, OPEN, SEP, close_tag, open_tag

CALL_OPEN, CALL_CLOSE = f"{OPEN}call", close_tag("call")
TOOLS_OPEN, TOOLS_CLOSE = open_tag("tools"), close_tag("tools")
ARGUMENT_OPEN, ARGUMENT_CLOSE = f"{OPEN}argument", close_tag("argument")
THINK_TAGS = (open_tag("think"), close_tag("think"))
RESPONSE_TAGS = (open_tag("response"), close_tag("response"))
END_OF_TURN = (close_tag("message"), END_OF_MESSAGE)
_SEP = re.escape(SEP)
_HEAD = re.compile(rf'\s*tool="([^"\n]+)"(?: index="\d*")?{_SEP}')
_ARGUMENT = re.compile(rf'\s*{re.escape(ARGUMENT_OPEN)} key="([^"\n]*)" type="([a-z]+)"{_SEP}')


class KimiK3Format:
    call_open = CALL_OPEN
    call_close = CALL_CLOSE
    block_open = TOOLS_OPEN
    block_close = TOOLS_CLOSE
    trims_around_calls = False  # the template writes the channels back to back
    call_separator = ""
    # A turn of calls only still has its (empty) response channel before them; kvserve's Kimi-K3 always thinks
    calls_prefix = "".join(RESPONSE_TAGS)
    argument_style = "kimi_k3_xml"

    def __init__(self, tools: list[dict] | None = None) -> None:
        del tools  # each argument is typed by its own tag

    def new_call(self) -> KimiK3CallParser:
        return KimiK3CallParser({})

    def body_is_open(self, body: str) -> bool:
        # Inside a value (raw text, often code) a closing tag is text.
        return body.count(ARGUMENT_OPEN) > body.count(ARGUMENT_CLOSE)

    def call_tag(self, name: str) -> tuple[str, str]:
        """The text before the call's index, and after its arguments."""
        return f'{CALL_OPEN} tool="{name}" index="', CALL_CLOSE

    def block_tag(self) -> tuple[str, str]:
        return TOOLS_OPEN, TOOLS_CLOSE

    def block_format(self) -> tuple[str, str]:
        """For the grammar: the channel, and the message's close after it (the next prompt's bytes up to its stop)."""
        return TOOLS_OPEN, TOOLS_CLOSE + END_OF_TURN[0]

    def arguments_format(self, schema: dict) -> dict:
        """For the grammar: the index the model picks, the end of the call's head, then its arguments."""
        return {"type": "sequence", "elements": [
            {"type": "regex", "pattern": "[0-9]{1,3}"}, {"type": "const_string", "value": f'"{SEP}'},
            # the template writes nothing between the argument tags; xgrammar's least is one character (read as layout)
            {"type": "json_schema", "json_schema": schema, "style": self.argument_style, "max_whitespace_cnt": 1}]}


class KimiK3CallParser(DsmlCallParser):
    """One call body: ` tool="NAME" index="N"<|sep|>` then `argument` blocks."""

    parameter_open = ARGUMENT_OPEN
    parameter_close = ARGUMENT_CLOSE
    parameter_tag = _ARGUMENT
    head = _HEAD

    def could_be_call(self, body: str) -> bool:
        return _HEAD.match(body) is not None or _may_be_head(body.lstrip())

    def tag_unfinished(self, rest: str) -> bool:
        return rest.startswith(ARGUMENT_OPEN) and SEP not in rest and "\n" not in rest

    def key(self, tag: re.Match) -> str:
        return _unescape(tag.group(1))

    def value(self, tag: re.Match, raw: str) -> object:
        if tag.group(2) == "string":
            return raw
        try:
            return json_text.loads(raw)
        except ValueError:
            return raw


def _may_be_head(text: str) -> bool:
    """`text` may still grow into a call's head (` tool="NAME" index="N"<|sep|>`)."""
    if 'tool="'.startswith(text):
        return True
    name = re.match(r'tool="[^"\n]*', text)
    if name is None:
        return False
    rest = text[name.end() + 1:]  # after the name's closing quote
    if len(text) == name.end() or ' index="'.startswith(rest):
        return True
    index = re.match(r' index="\d*', rest)
    if index is None:
        return SEP.startswith(rest)
    after = rest[index.end():]
    return not after or (after[0] == '"' and SEP.startswith(after[1:]))


def _unescape(value: str) -> str:
    return value.replace("&quot;", '"').replace("&amp;", "&")
