"""DeepSeek tool calls, written with special tokens (FULLWIDTH `｜` and `▁`).

V3 / V3-0324 / R1 / R1-0528 / R1-Distill: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME⏎```json⏎
{args}⏎```<｜tool▁call▁end｜>` (calls joined by `⏎`) `<｜tool▁calls▁end｜>`.
V3.1: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{args}<｜tool▁call▁end｜>…<｜tool▁calls▁end｜>`.
"""
from __future__ import annotations

import re

from server.parsing.deltas import ParsedCall
from server.parsing.jsonargs import is_json_object

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"

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


class _DeepSeekTokens:
    call_open = CALL_BEGIN
    call_close = CALL_END
    block_open = CALLS_BEGIN
    block_close = CALLS_END
    trims_around_calls = False

    def body_is_open(self, body: str) -> bool:
        return False  # the markers are special tokens, which never occur inside argument text


class DeepSeekV3Format(_DeepSeekTokens):
    def parse_call(self, body: str) -> ParsedCall | None:
        _kind, sep, rest = body.partition(SEP)
        name, newline, fenced = rest.partition("\n")
        name = name.strip()
        if not sep or not newline or not name:
            return None
        arguments = _arguments(fenced)
        return ParsedCall(name, arguments) if arguments is not None else None

    def call_prefix(self, name: str | None) -> str:
        head = f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}"
        return head if name is None else f"{head}{name}\n```json\n"


class DeepSeekV31Format(_DeepSeekTokens):
    def parse_call(self, body: str) -> ParsedCall | None:
        name, sep, rest = body.partition(SEP)
        name = name.strip()
        if not sep or not name:
            return None
        arguments = _arguments(rest)
        return ParsedCall(name, arguments) if arguments is not None else None

    def call_prefix(self, name: str | None) -> str:
        head = f"{CALLS_BEGIN}{CALL_BEGIN}"
        return head if name is None else f"{head}{name}{SEP}"
