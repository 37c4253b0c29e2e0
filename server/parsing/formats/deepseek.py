"""DeepSeek tool calls, written with special tokens (FULLWIDTH `｜` and `▁`).

V3 / V3-0324 / R1 / R1-0528 / R1-Distill: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME⏎```json⏎
{args}⏎```<｜tool▁call▁end｜>` (calls joined by `⏎`) `<｜tool▁calls▁end｜>`.
V3.1: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{args}<｜tool▁call▁end｜>…<｜tool▁calls▁end｜>`.
"""
from __future__ import annotations

import re
from abc import ABC, abstractmethod

from server.parsing.deltas import ParsedCall
from server.parsing.json_call import JsonCallParser
from server.parsing.jsonargs import ends_inside_string, is_json_object

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"

FENCE_OPEN = "```json\n"
_FENCED = re.compile(r"```json\n(.*)\n```", re.DOTALL)


def _arguments(text: str) -> str | None:
    """The arguments JSON object text: the exact bytes inside the template's fence when the model wrote that form
    (the template concatenates them back verbatim), else the text with any fence and surrounding space removed."""
    fenced = _FENCED.fullmatch(text)
    if fenced and is_json_object(fenced.group(1)):
        return fenced.group(1)
    if is_json_object(text):
        return text
    stripped = text.strip().removeprefix("```json").removeprefix("```").removesuffix("```").strip()
    return stripped if is_json_object(stripped) else None


class _DeepSeekTokens(ABC):
    call_open = CALL_BEGIN
    call_close = CALL_END
    block_open = CALLS_BEGIN
    block_close = CALLS_END
    trims_around_calls = False
    argument_style = "json"
    calls_prefix = ""

    def block_tag(self) -> tuple[str, str]:
        return CALLS_BEGIN, CALLS_END

    def body_is_open(self, body: str) -> bool:
        # A marker inside a string value (code that mentions it) is text; the name part holds no quotes.
        return ends_inside_string(body)

    def new_call(self) -> JsonCallParser:
        return JsonCallParser(self._header, self._parse_whole)

    @abstractmethod
    def _head(self, body: str) -> tuple[str, int] | None:
        """The function name and where the arguments text starts, once the body has come that far."""

    def _header(self, body: str) -> tuple[str, int] | None:
        """Streamable once the arguments object begins, directly or inside the template's fence."""
        head = self._head(body)
        if head is None:
            return None
        name, at = head
        if body.startswith(FENCE_OPEN, at):
            at += len(FENCE_OPEN)
        return (name, at) if body.startswith("{", at) else None

    def _parse_whole(self, body: str) -> ParsedCall | None:
        head = self._head(body)
        arguments = _arguments(body[head[1] :]) if head else None
        return ParsedCall(head[0], arguments) if head and arguments is not None else None


class DeepSeekV3Format(_DeepSeekTokens):
    def _head(self, body: str) -> tuple[str, int] | None:
        _kind, sep, rest = body.partition(SEP)
        name, newline, arguments = rest.partition("\n")
        name = name.strip()
        return (name, len(body) - len(arguments)) if sep and newline and name else None

    call_separator = "\n"

    def call_tag(self, name: str) -> tuple[str, str]:
        return f"{CALL_BEGIN}function{SEP}{name}\n{FENCE_OPEN}", f"\n```{CALL_END}"


class DeepSeekV31Format(_DeepSeekTokens):
    def _head(self, body: str) -> tuple[str, int] | None:
        name, sep, rest = body.partition(SEP)
        name = name.strip()
        return (name, len(body) - len(rest)) if sep and name else None

    call_separator = ""

    def call_tag(self, name: str) -> tuple[str, str]:
        return f"{CALL_BEGIN}{name}{SEP}", CALL_END
