"""What the parsers produce, API-neutral: parsed calls, deltas (the pieces of output as they are parsed), the items
they build (runs of answer text or reasoning, and tool calls, in the order generated), and the final message.
Each API formats these its own way (server/api/chat.py, server/api/messages.py, server/api/responses.py)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class ParsedCall:
    """One tool call recognised in the model output; `arguments` is the text of a JSON object; `call_id` the id the
    model wrote for it (Kimi's `functions.NAME:IDX`, which its template renders back), '' when its format has none."""

    name: str
    arguments: str
    call_id: str = ""


DeltaKind = Literal["text", "reasoning", "call", "arguments"]
ItemKind = Literal["text", "reasoning", "call"]
_ITEM_KINDS: dict[DeltaKind, ItemKind] = {"text": "text", "reasoning": "reasoning", "call": "call", "arguments": "call"}


@dataclass(frozen=True)
class Delta:
    """One parsed piece of output. `text` is answer text, reasoning, the called function's name (kind "call", which
    starts call `call_index` with id `call_id`) or an arguments fragment of call `call_index`. `item`: the index of
    the `OutputItem` it belongs to (a new index starts a new item)."""

    kind: DeltaKind
    text: str
    item: int
    call_index: int = -1
    call_id: str = ""


@dataclass
class OutputItem:
    """A run of answer text or of reasoning, or one tool call (`text`: its arguments as generated). Text grows by
    `append` into a list of parts joined when read, so an output of many small pieces costs linear time (`+=` on an
    attribute copies the whole string each time)."""

    kind: ItemKind
    name: str = ""  # a call's function
    call_id: str = ""
    _parts: list[str] = field(default_factory=list, repr=False)

    def append(self, text: str) -> None:
        self._parts.append(text)

    @property
    def text(self) -> str:
        if len(self._parts) > 1:
            self._parts[:] = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""


@dataclass
class ParsedMessage:
    """The assistant message as the non-streaming API returns it."""

    content: str | None
    reasoning_content: str | None
    tool_calls: list[dict] = field(default_factory=list)
    finish_reason_override: Literal["tool_calls"] | None = None

    @classmethod
    def of(cls, items: list[OutputItem]) -> ParsedMessage:
        content = "".join(item.text for item in items if item.kind == "text")
        reasoning = "".join(item.text for item in items if item.kind == "reasoning")
        calls = [tool_call_dict(item.call_id, item.name, item.text) for item in items if item.kind == "call"]
        return cls(content=content if content or not calls else None, reasoning_content=reasoning or None,
                   tool_calls=calls, finish_reason_override="tool_calls" if calls else None)

    def to_message(self) -> dict:
        return {
            "role": "assistant",
            "content": self.content,
            "reasoning_content": self.reasoning_content,
            "tool_calls": self.tool_calls,
        }


class OutputItems:
    """The output's items, built from its deltas (the one place parsed output accumulates)."""

    def __init__(self) -> None:
        self.items: list[OutputItem] = []
        self.num_calls = 0

    def add(self, kind: DeltaKind, text: str, call_id: str = "") -> Delta:
        """Append one piece; returns its delta."""
        item_kind = _ITEM_KINDS[kind]
        if kind == "call" or not self.items or self.items[-1].kind != item_kind:
            self.items.append(OutputItem(item_kind, name=text, call_id=call_id) if kind == "call"
                              else OutputItem(item_kind))
            self.num_calls += kind == "call"
        if kind != "call":
            self.items[-1].append(text)
        call_index = self.num_calls - 1 if item_kind == "call" else -1
        return Delta(kind, text, len(self.items) - 1, call_index, call_id)


def tool_call_id(id_prefix: str, index: int) -> str:
    """Ids are `call_<prefix><index as hex>`: unique within a request, reproducible given the prefix."""
    return f"call_{id_prefix}{index:04x}"


def tool_call_dict(call_id: str, name: str, arguments: str = "") -> dict:
    """A call as chat completions' final message holds it."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def merge(deltas: list[Delta]) -> list[Delta]:
    """Joins neighbouring deltas of one item (text, reasoning, one call's arguments) so one feed yields one per run."""
    runs: list[list[Delta]] = []
    for delta in deltas:
        last = runs[-1][0] if runs else None
        if last is not None and delta.kind != "call" and last.kind == delta.kind and last.item == delta.item:
            runs[-1].append(delta)
        else:
            runs.append([delta])
    return [run[0] if len(run) == 1 else
            Delta(run[0].kind, "".join(d.text for d in run), run[0].item, run[0].call_index, run[0].call_id)
            for run in runs]
