"""Anthropic's server-side compaction (`compact_20260112` in `context_management.edits`, beta `compact-2026-01-12`):
the edit's settings, the conversations of its two generations, and the `compaction` block a later request sends
back.

Once the prompt (as rendered, after the other edits) reaches `trigger` input tokens (default 150,000; Anthropic's
minimum of 50,000 is not enforced: local models have smaller contexts), one request runs two generations:
1. the summary turn: the conversation as sent plus one user message asking for the summary (`instructions`, which
   replace the default `COMPACTION_PROMPT`), so it extends the prompt the client's last turn cached;
2. the reply, over the compacted conversation: system prompt and tools byte for byte as before (read from the
   cache), then the summary as one user message (`SUMMARY_PREFIX`), as `server/api/compaction.py` renders a
   Responses `compaction` item. With `pause_after_compaction` the response ends after the block instead
   (`stop_reason: "compaction"`); sent back, the block then asks for the reply.
The response starts with `{"type": "compaction", "content": <summary>}`; `usage.iterations` lists the summary turn
(`type: "compaction"`) and the reply (`type: "message"`); the top-level counts are the reply's alone.

A later request that carries a compaction block (in an assistant message) drops every message and block before the
last one with content, as the API does: the conversation restarts from its summary. A block whose content is null
(a failed compaction) is a no-op; empty content or a block outside an assistant message is a 400.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from server.api.anthropic_protocol import AnthropicMessage, Conversation
from server.api.compaction import COMPACTION_PROMPT, SUMMARY_MAX_TOKENS, SUMMARY_PREFIX
from server.api.protocol import APIError

COMPACT = "compact_20260112"
BLOCK_TYPE = "compaction"
DEFAULT_TRIGGER_TOKENS = 150_000
STOP_REASON = "compaction"  # with pause_after_compaction


@dataclass(frozen=True)
class Compact:
    """A `compact_20260112` edit."""

    trigger_tokens: int = DEFAULT_TRIGGER_TOKENS
    instructions: str | None = None  # replaces COMPACTION_PROMPT
    pause: bool = False  # pause_after_compaction: the response ends with the block

    @property
    def prompt(self) -> str:
        return self.instructions if self.instructions and self.instructions.strip() else COMPACTION_PROMPT


def _bad(message: str, where: str) -> APIError:
    return APIError(400, f"{where}: {message}", param=where)


def parse_compact(edit: dict, where: str) -> Compact:
    trigger = edit.get("trigger")
    tokens = DEFAULT_TRIGGER_TOKENS
    if trigger is not None:
        value = trigger.get("value") if isinstance(trigger, dict) else None
        if not isinstance(trigger, dict) or trigger.get("type") != "input_tokens":
            raise _bad("must be an object with 'type' 'input_tokens' and a 'value'", f"{where}.trigger")
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise _bad("'value' must be a positive integer", f"{where}.trigger.value")
        tokens = value
    instructions = edit.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _bad("must be a string", f"{where}.instructions")
    pause = edit.get("pause_after_compaction", False)
    if not isinstance(pause, bool):
        raise _bad("must be a boolean", f"{where}.pause_after_compaction")
    return Compact(tokens, instructions, pause)


def summary_block(summary: str) -> dict[str, Any]:
    """The compaction block of a summary (content null: the summary turn wrote nothing, a failed compaction)."""
    return {"type": BLOCK_TYPE, "content": summary or None}


def summary_turn(conversation: Conversation, compact: Compact) -> Conversation:
    """The summary turn's conversation: the one sent, and the request for its summary."""
    ask = AnthropicMessage(role="user", content=[{"type": "text", "text": compact.prompt}])
    return conversation.model_copy(update={"messages": [*conversation.messages, ask]})


def summary_max_tokens(max_tokens: int | None) -> int:
    return min(SUMMARY_MAX_TOKENS, max_tokens or SUMMARY_MAX_TOKENS)


def compacted(conversation: Conversation, summary: str) -> Conversation:
    """The conversation the reply is generated from: system prompt and tools as sent, the summary in place of the
    messages (an empty summary, a failed compaction, changes nothing)."""
    if not summary:
        return conversation
    return conversation.model_copy(update={"messages": [_summary_message(summary)]})


def _summary_message(summary: str) -> AnthropicMessage:
    return AnthropicMessage(role="user", content=[{"type": "text", "text": SUMMARY_PREFIX + summary}])


def from_last_compaction(conversation: Conversation) -> tuple[Conversation, int]:
    """The conversation from its last compaction block on (the block read as its summary, the rest of its assistant
    message kept), and how many compactions it went through (its epoch). A conversation without one comes back as
    it is, with epoch 0."""
    last: tuple[int, int] | None = None
    epoch = 0
    messages = list(conversation.messages)
    for i, message in enumerate(messages):
        blocks = message.content if isinstance(message.content, list) else []
        for j, block in enumerate(blocks):
            if not isinstance(block, dict) or block.get("type") != BLOCK_TYPE:
                continue
            where = f"messages.{i}.content.{j}"
            if message.role != "assistant":
                raise _bad("a compaction block belongs in an assistant message (as the response returned it)", where)
            content = block.get("content")
            if content is not None and (not isinstance(content, str) or not content):
                raise _bad("a compaction block's 'content' must be a non-empty string, or null", f"{where}.content")
            if content is not None:
                last, epoch = (i, j), epoch + 1
    if last is None:
        return _without_blocks(conversation), 0
    i, j = last
    summary = _summary_message(messages[i].content[j]["content"])
    rest = messages[i].model_copy(update={"content": messages[i].content[j + 1:]})
    return _without_blocks(conversation.model_copy(update={"messages": [summary, rest, *messages[i + 1:]]})), epoch


def _without_blocks(conversation: Conversation) -> Conversation:
    """Null-content blocks (failed compactions) are no-ops: left out, and a message they leave empty with them."""
    def kept(message: AnthropicMessage) -> AnthropicMessage:
        if not isinstance(message.content, list):
            return message
        return message.model_copy(update={"content": [b for b in message.content
                                                      if not (isinstance(b, dict) and b.get("type") == BLOCK_TYPE)]})

    messages = [kept(m) for m in conversation.messages]
    if messages == conversation.messages:
        return conversation
    return conversation.model_copy(update={"messages": [m for m in messages if m.content != []]})


def iteration(kind: str, usage: dict[str, int]) -> dict[str, Any]:
    """One entry of `usage.iterations` (``kind``: "compaction" or "message") from a generation's Anthropic usage."""
    return {"type": kind, **{k: usage[k] for k in ("input_tokens", "output_tokens", "cache_read_input_tokens",
                                                   "cache_creation_input_tokens")}}
