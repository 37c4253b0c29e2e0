"""Kimi's tool calls (Kimi-K2, Kimi Linear): one section of calls after the turn's text,
`<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{args}<|tool_call_end|>…
<|tool_calls_section_end|>`, calls back to back.

The call's header (`functions.NAME:IDX`) is its id: the template writes each call's id there, so the parser returns
the model's own header as the call's id (as vLLM's kimi_k2 parser does), and the next turn renders the model's bytes
again. The name is the header without `functions.` and its `:IDX`. Under a grammar (tool_choice required or named)
the model writes IDX itself (1-3 digits), so parallel calls keep ids of their own, and each marker as its one token;
under auto the model writes freely (its markers are tokens no text trigger sees).
"""
from __future__ import annotations

from server.parsing.deltas import ParsedCall
from server.parsing.json_call import JsonCallParser
from server.parsing.jsonargs import ends_inside_string, is_json_object
from server.rendering.native.kimi import ARGUMENT_BEGIN, CALL_BEGIN, CALL_END, SECTION_BEGIN, SECTION_END

ID_PREFIX = "functions."


def function_name(header: str) -> str:
    """`functions.NAME:IDX` -> NAME (a header without the prefix or the index is the name as it is)."""
    head = header.removeprefix(ID_PREFIX)
    name, colon, index = head.rpartition(":")
    return name if colon and index.isdigit() else head


def _head(body: str) -> tuple[str, str, int] | None:
    """(the call's id, its function name, where its arguments start) once the argument marker is written."""
    header, marker, rest = body.partition(ARGUMENT_BEGIN)
    header = header.strip()
    name = function_name(header) if marker else ""
    return (header, name, len(body) - len(rest)) if name else None


def _parse_whole(body: str) -> ParsedCall | None:
    head = _head(body)
    if head is None:
        return None
    arguments = body[head[2]:].strip()
    return ParsedCall(head[1], arguments, call_id=head[0]) if is_json_object(arguments) else None


class _KimiCall(JsonCallParser):
    """Streams once the arguments object begins; `call_id` is the header it read."""

    def __init__(self) -> None:
        super().__init__(self._streamable, _parse_whole)
        self.call_id = ""

    def _streamable(self, body: str) -> tuple[str, int] | None:
        head = _head(body)
        if head is None:
            return None
        start = len(body) - len(body[head[2]:].lstrip())
        if not body.startswith("{", start):
            return None
        self.call_id = head[0]
        return head[1], start


class KimiFormat:
    call_open = CALL_BEGIN
    call_close = CALL_END
    block_open = SECTION_BEGIN
    block_close = SECTION_END
    trims_around_calls = False  # the template concatenates the text and the section
    argument_style = "json"
    call_separator = ""
    calls_prefix = ""

    def __init__(self, tools: list[dict] | None = None) -> None:
        del tools  # JSON arguments: the schema is only the grammar's

    def block_tag(self) -> tuple[str, str]:
        return SECTION_BEGIN, SECTION_END

    def body_is_open(self, body: str) -> bool:
        return ends_inside_string(body)  # a marker inside a string value is text

    def new_call(self) -> _KimiCall:
        return _KimiCall()

    def call_tag(self, name: str) -> tuple[str, str]:
        """The text before the call's index, and after its arguments."""
        return f"{CALL_BEGIN}{ID_PREFIX}{name}:", CALL_END

    # The grammar writes the markers as the one token each is (a marker spelled in pieces would be tokenized back
    # whole in the next prompt, and miss the cache from there), and the index as the model picks it.
    def call_format(self, name: str, arguments: dict) -> dict:
        return {"type": "tag", "begin": _token(CALL_BEGIN), "end": _token(CALL_END), "content": {
            "type": "sequence", "elements": [{"type": "const_string", "value": f"{ID_PREFIX}{name}:"},
                                             {"type": "regex", "pattern": "[0-9]{1,3}"}, _token(ARGUMENT_BEGIN),
                                             arguments]}}

    def block_format(self) -> tuple[dict, dict]:
        return _token(SECTION_BEGIN), _token(SECTION_END)


def _token(marker: str) -> dict:
    return {"type": "token", "token": marker}
