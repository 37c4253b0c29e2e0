"""Anthropic context editing: a Messages request's `context_management.edits`, applied to its conversation before it
is rendered, and what they cleared (`context_management.applied_edits`).

- `clear_tool_uses_20250919`: once `trigger` is reached (`{"type": "input_tokens" | "tool_uses", "value": N}`,
  default 100,000 input tokens), the results of the oldest tool uses are replaced by `CLEARED_RESULT`, all but the
  last `keep` (`{"type": "tool_uses", "value": N}`, default 3) and those of `exclude_tools`; `clear_tool_inputs`
  (true, or a list of tool names) clears their inputs too. With `clear_at_least` (`{"type": "input_tokens",
  "value": N}`) the clearing goes in batches: the cleared part is the shortest run of the oldest candidates whose
  tokens reach the largest multiple of N that the candidates hold. That boundary depends only on the history before
  it, so it stays where it is, and every request's prompt extends the last one's, until the candidates grow by
  another N tokens: the cache breaks once a batch, not on every turn.
- `clear_thinking_20251015`: the thinking blocks of all but the last `keep` (`{"type": "thinking_turns", "value":
  N}`, default 1; `"all"` keeps every one) assistant messages are dropped.
- `compact_20260112` (server/api/messages_compaction.py) is not applied here: the request reports it (`Edited.compact`)
  with the prompt's length after the other edits, and the Messages adapter runs the compaction once it is reached.
  A compaction block the client sent back is read first: the conversation restarts from its summary.

Each edit that cleared something is reported with the tool uses or thinking turns it cleared and the prompt tokens
that removed (measured by rendering before and after). The client keeps its full history; the edits are redone from
it on every request, the same way each time.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from server.api.anthropic_protocol import AnthropicMessage, Conversation
from server.api.messages_compaction import COMPACT, Compact, from_last_compaction, parse_compact
from server.api.messages_input import to_turn
from server.api.protocol import APIError
from server.pipeline.context import ServingContext
from server.pipeline.images import expand, prompt_text, turn_images
from server.pipeline.plan import render_turn, with_cached_content
from server.pipeline.turn import Turn

CLEAR_TOOL_USES = "clear_tool_uses_20250919"
CLEAR_THINKING = "clear_thinking_20251015"
CLEARED_RESULT = "[This tool result was cleared to save context.]"
DEFAULT_TRIGGER_TOKENS = 100_000
DEFAULT_KEEP_TOOL_USES = 3
DEFAULT_KEEP_THINKING_TURNS = 1
_THINKING_BLOCKS = ("thinking", "redacted_thinking")
PARAM = "context_management.edits"


def _bad(message: str, where: str) -> APIError:
    return APIError(400, f"{where}: {message}", param=where)


@dataclass(frozen=True)
class ClearToolUses:
    trigger_kind: str = "input_tokens"  # or "tool_uses"
    trigger_value: int = DEFAULT_TRIGGER_TOKENS
    keep: int = DEFAULT_KEEP_TOOL_USES
    clear_at_least: int = 0  # tokens per batch (0: clear every candidate each time)
    exclude_tools: frozenset[str] = frozenset()
    clear_inputs: bool | frozenset[str] = False  # every cleared tool use's input, or those of these tools


@dataclass(frozen=True)
class ClearThinking:
    keep: int | None = DEFAULT_KEEP_THINKING_TURNS  # None: every turn keeps its thinking


Edit = ClearToolUses | ClearThinking | Compact


def _count(value: Any, kinds: tuple[str, ...], where: str) -> tuple[str, int]:
    if not isinstance(value, dict) or value.get("type") not in kinds:
        raise _bad(f"must be an object with 'type' {' or '.join(repr(k) for k in kinds)} and a 'value'", where)
    number = value.get("value")
    if not isinstance(number, int) or isinstance(number, bool) or number < 0:
        raise _bad("'value' must be a non-negative integer", f"{where}.value")
    return value["type"], number


def _names(value: Any, where: str) -> frozenset[str]:
    if not isinstance(value, list) or not all(isinstance(name, str) for name in value):
        raise _bad("must be a list of tool names", where)
    return frozenset(value)


def parse_edits(config: Any) -> list[Edit]:
    """`context_management` as edits; a 400 naming the field for anything else (another edit type included)."""
    if config is None:
        return []
    edits = config.get("edits") if isinstance(config, dict) else None
    if not isinstance(edits, list):
        raise _bad("must be a list of edits", PARAM)
    parsed: list[Edit] = []
    for i, edit in enumerate(edits):
        where = f"{PARAM}.{i}"
        kind = edit.get("type") if isinstance(edit, dict) else None
        if kind == CLEAR_TOOL_USES:
            parsed.append(_clear_tool_uses(edit, where))
        elif kind == CLEAR_THINKING:
            keep = edit.get("keep", {"type": "thinking_turns", "value": DEFAULT_KEEP_THINKING_TURNS})
            all_turns = keep == "all" or (isinstance(keep, dict) and keep.get("type") == "all")
            parsed.append(ClearThinking(None if all_turns else _count(keep, ("thinking_turns",), f"{where}.keep")[1]))
        elif kind == COMPACT:
            parsed.append(parse_compact(edit, where))
        else:
            raise _bad(f"edit type {kind!r} is not supported here (supported: {CLEAR_TOOL_USES}, {CLEAR_THINKING}, "
                       f"{COMPACT})", f"{where}.type")
    return parsed


def _clear_tool_uses(edit: dict, where: str) -> ClearToolUses:
    kind, value = "input_tokens", DEFAULT_TRIGGER_TOKENS
    if edit.get("trigger") is not None:
        kind, value = _count(edit["trigger"], ("input_tokens", "tool_uses"), f"{where}.trigger")
    keep = DEFAULT_KEEP_TOOL_USES
    if edit.get("keep") is not None:
        keep = _count(edit["keep"], ("tool_uses",), f"{where}.keep")[1]
    at_least = 0
    if edit.get("clear_at_least") is not None:
        at_least = _count(edit["clear_at_least"], ("input_tokens",), f"{where}.clear_at_least")[1]
    inputs = edit.get("clear_tool_inputs") or False
    if not isinstance(inputs, bool):
        inputs = _names(inputs, f"{where}.clear_tool_inputs")
    exclude = _names(edit["exclude_tools"], f"{where}.exclude_tools") if edit.get("exclude_tools") else frozenset()
    return ClearToolUses(kind, value, keep, at_least, exclude, inputs)


@dataclass(frozen=True)
class _ToolUse:
    message: int  # the assistant message holding the tool_use block
    block: int
    id: str
    name: str


def _tool_uses(messages: list[AnthropicMessage]) -> list[_ToolUse]:
    return [_ToolUse(m, b, str(block.get("id")), str(block.get("name")))
            for m, message in enumerate(messages) if message.role == "assistant" and isinstance(message.content, list)
            for b, block in enumerate(message.content) if isinstance(block, dict) and block.get("type") == "tool_use"]


def _results(messages: list[AnthropicMessage]) -> dict[str, tuple[int, int]]:
    """tool_use_id -> (message, block) of its tool_result."""
    return {str(block.get("tool_use_id")): (m, b)
            for m, message in enumerate(messages) if message.role == "user" and isinstance(message.content, list)
            for b, block in enumerate(message.content)
            if isinstance(block, dict) and block.get("type") == "tool_result"}


def _clears_input(edit: ClearToolUses, name: str) -> bool:
    return edit.clear_inputs is True or (isinstance(edit.clear_inputs, frozenset) and name in edit.clear_inputs)


def _batch(costs: list[int], at_least: int) -> int:
    """How many of the oldest candidates to clear: all without a batch size; else the shortest run reaching the
    largest multiple of ``at_least`` the candidates hold (0 below one batch)."""
    if at_least <= 0:
        return len(costs)
    goal, total = sum(costs) // at_least * at_least, 0
    for n, cost in enumerate(costs, 1):
        total += cost
        if goal and total >= goal:
            return n
    return 0


@dataclass
class Edited:
    """The conversation after the edits, and the `applied_edits` to report (prompt tokens before: ``original``,
    after: ``tokens``); its `compact_20260112` edit, not applied yet, and the compactions it went through."""

    conversation: Conversation
    applied: list[dict[str, Any]]
    original_tokens: int
    tokens: int = 0
    compact: Compact | None = None
    epoch: int = 0


def apply_edits(req: Conversation, edits: list[Edit], count: Callable[[Conversation], int],
                size: Callable[[str], int]) -> Edited:
    """``count``: a conversation's prompt tokens as rendered; ``size``: a text's tokens (to size the batches)."""
    before = original = count(req)
    applied: list[dict[str, Any]] = []
    compact = None
    for edit in edits:
        if isinstance(edit, Compact):
            compact = edit
            continue
        if isinstance(edit, ClearToolUses):
            messages, cleared = _clear_tool_uses_in(req.messages, edit, before, size)
            report = {"type": CLEAR_TOOL_USES, "cleared_tool_uses": cleared}
        else:
            messages, cleared = _clear_thinking_in(req.messages, edit)
            report = {"type": CLEAR_THINKING, "cleared_thinking_turns": cleared}
        if not cleared:
            continue
        req = req.model_copy(update={"messages": messages})
        after = count(req)
        applied.append({**report, "cleared_input_tokens": before - after})
        before = after
    return Edited(req, applied, original, before, compact)


def _clear_tool_uses_in(messages: list[AnthropicMessage], edit: ClearToolUses, tokens: int,
                        size: Callable[[str], int]) -> tuple[list[AnthropicMessage], int]:
    uses = _tool_uses(messages)
    reached = tokens >= edit.trigger_value if edit.trigger_kind == "input_tokens" else len(uses) >= edit.trigger_value
    if not reached:
        return messages, 0
    results = _results(messages)
    kept = uses[len(uses) - edit.keep:] if edit.keep else []
    candidates = [u for u in uses if u not in kept and u.name not in edit.exclude_tools]
    def tokens(m: int, b: int, key: str) -> int:
        return size(json.dumps(messages[m].content[b].get(key), ensure_ascii=False))  # type: ignore[union-attr]

    costs = [(tokens(*results[use.id], "content") if use.id in results else 0)
             + (tokens(use.message, use.block, "input") if _clears_input(edit, use.name) else 0)
             for use in candidates]
    cleared = candidates[:_batch(costs, edit.clear_at_least)]
    if not cleared:
        return messages, 0
    blocks = {i: list(m.content) if isinstance(m.content, list) else m.content for i, m in enumerate(messages)}
    for use in cleared:
        if use.id in results:
            m, b = results[use.id]
            blocks[m][b] = {**blocks[m][b], "content": CLEARED_RESULT}  # type: ignore[index]
        if _clears_input(edit, use.name):
            blocks[use.message][use.block] = {**blocks[use.message][use.block], "input": {}}  # type: ignore[index]
    return [m.model_copy(update={"content": blocks[i]}) for i, m in enumerate(messages)], len(cleared)


def _clear_thinking_in(messages: list[AnthropicMessage], edit: ClearThinking) -> tuple[list[AnthropicMessage], int]:
    if edit.keep is None:
        return messages, 0
    turns = [i for i, m in enumerate(messages) if m.role == "assistant" and isinstance(m.content, list) and any(
        isinstance(b, dict) and b.get("type") in _THINKING_BLOCKS for b in m.content)]
    cleared = set(turns[: max(0, len(turns) - edit.keep)])
    out = [m.model_copy(update={"content": [b for b in m.content if not (isinstance(b, dict) and b.get("type") in
                                                                           _THINKING_BLOCKS)]})
           if i in cleared else m for i, m in enumerate(messages)]
    return out, len(cleared)


def edit_conversation(ctx: ServingContext, req: Conversation, cache_salt: str | None) -> Edited:
    """The request's conversation from its last compaction block on, with its `context_management` edits applied,
    counted as `/v1/messages` renders it (a request without edits is not counted)."""
    edits = parse_edits(req.context_management)
    req, epoch = from_last_compaction(req)
    if not edits:
        return Edited(req, [], 0, epoch=epoch)

    def count(conversation: Conversation) -> int:
        return turn_tokens(ctx, with_cached_content(ctx, to_turn(conversation, ctx.family), cache_salt))

    return replace(apply_edits(req, edits, count, lambda text: len(ctx.encode(text))), epoch=epoch)


def turn_tokens(ctx: ServingContext, turn: Turn) -> int:
    """A turn's prompt tokens as `/v1/messages` renders it, each image counted at its tokens (an image read as
    text would be a 400: Claude Code's Read tool returns screenshots inside tool results)."""
    turn, images = turn_images(ctx.images, turn)
    text = prompt_text(ctx.images, render_turn(ctx, turn), images)
    return len(expand(ctx.images, ctx.encode(text), images).token_ids)
