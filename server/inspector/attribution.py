"""One live request against its session's previous one: where its prompt first leaves the previous context (prompt
and reply) and why, and every missed prompt token's cause, named as the prefix benchmark names them
(server/cache/miss_causes.py)."""
from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from hashlib import blake2b
from typing import Any

from server.inspector.prompt_trie import common_prefix_packed, num_tokens, unpack
from server.cache.miss_causes import (
    CHANGE_CONTEXT_EDIT,
    CHANGE_HISTORY,
    CHANGE_IMAGE,
    CHANGE_PROMPT,
    CHANGE_REPLY,
    CHANGE_TEMPLATE,
    message_change,
    miss_causes,
    template_change,
)

# Tokens decoded on each side of a divergence to tell a template's change apart (the texts agree before it).
_TEXT_WINDOW = (8, 32)


@dataclass(frozen=True, slots=True)
class Conversation:
    """A request as the client sent it, in the chat form (None for raw text prompts), cache rules applied."""

    messages: list[dict] | None = None
    tools: list[Any] | None = None
    epoch: int = 0  # the compactions it went through (server/api/compaction.py): a new one starts an epoch
    edited: bool = False  # the server edited it before rendering (server/api/context_edits.py)

    def digest(self) -> Conversation:
        """The same conversation as each message's role and a hash of it, and a hash of the tools: what comparing
        it with the next request needs, in a few bytes a message (the text itself is in the trie, as tokens)."""
        if self.messages is None:
            return self
        messages = [{"role": m.get("role") if isinstance(m, dict) else None, "hash": _hash(m)} for m in self.messages]
        return Conversation(messages, [_hash(self.tools)] if self.tools else None, self.epoch, self.edited)


def _hash(value: Any) -> str:
    return blake2b(json.dumps(value, sort_keys=True, default=str).encode(), digest_size=12).hexdigest()


@dataclass(frozen=True, slots=True)
class Previous:
    """What the session's previous request left: its prompt and reply (packed token ids, server/inspector/
    prompt_trie.py), how much of that is prompt, and its conversation's digest (`Conversation.digest`)."""

    context: bytes
    prompt_tokens: int
    conversation: Conversation


ImageSpans = tuple[tuple[int, bytes], ...]  # a prompt's images: (offset of its first token, content hash)


def first_image_change(images: ImageSpans, previous: ImageSpans) -> int | None:
    """The offset of the first image whose content differs from the image the previous prompt had at the same
    place (None: none does). Its tokens may all be equal (the same size): only the hashes tell."""
    before = dict(previous)
    return next((offset for offset, content in sorted(images)
                 if offset in before and before[offset] != content), None)


@dataclass(frozen=True, slots=True)
class Divergence:
    index: int  # the first prompt token that differs from the previous context
    cause: str  # a key of server.cache.miss_causes.CAUSES
    in_reply: bool  # the previous context differs there in its reply, not in its prompt


def attribute(prompt: bytes, cached: int, ideal: int, ideal_unsalted: int, previous: Previous | None,
              conversation: Conversation, decode: Callable[[list[int]], str],
              image_change: int | None = None) -> tuple[Divergence | None, Counter]:
    """``prompt``: packed token ids. ``ideal`` / ``ideal_unsalted``: what an unbounded cache over the inspector's
    window would have served, with salts and ignoring them. ``decode`` turns token ids into text (a few dozen at a
    time). ``image_change``: where an image differs from the previous prompt's (`first_image_change`)."""
    prompt_tokens = num_tokens(prompt)
    if previous is None:
        return None, miss_causes(prompt_tokens, cached, ideal, ideal_unsalted, None, None)
    context_tokens = num_tokens(previous.context)
    index = common_prefix_packed(prompt, previous.context)
    divergence = None
    if image_change is not None and image_change < index:  # equal tokens, another image
        index = image_change
        divergence = Divergence(index, CHANGE_IMAGE, index >= previous.prompt_tokens)
    elif index < min(context_tokens, prompt_tokens):
        cause = _cause(prompt, previous, conversation, index, decode)
        divergence = Divergence(index, cause, index >= previous.prompt_tokens)
    misses = miss_causes(prompt_tokens, cached, ideal, ideal_unsalted, min(context_tokens, prompt_tokens),
                         divergence.cause if divergence else None)
    return divergence, misses


def _cause(prompt: bytes, previous: Previous, conversation: Conversation, index: int,
           decode: Callable[[list[int]], str]) -> str:
    old, new = previous.conversation, conversation.digest()
    if old.messages is None or new.messages is None:
        if old.messages is None and new.messages is None:
            return CHANGE_PROMPT
        return CHANGE_TEMPLATE  # one of them came through another API: rendered differently
    change = message_change(old.messages, old.tools, new.messages, new.tools)
    if change == CHANGE_HISTORY and new.edited and new.epoch == old.epoch:
        return CHANGE_CONTEXT_EDIT  # the server cleared part of the history, the client did not compact it
    if change is not None:
        return change
    if index >= previous.prompt_tokens:
        reply = decode(unpack(previous.context, previous.prompt_tokens))
        if _reply_differs(reply, conversation.messages, len(old.messages)):
            return CHANGE_REPLY
    before, after = _TEXT_WINDOW
    start = max(0, index - before)
    old_text = decode(unpack(previous.context, start, index + after))
    return template_change(old_text, decode(unpack(prompt, start, index + after))) or CHANGE_TEMPLATE


def _reply_differs(output_text: str, messages: list[dict], at: int) -> bool:
    """Whether the message the client put where the model's reply goes is not that reply: not an assistant message,
    or text or tool calls the model did not write."""
    message = messages[at] if at < len(messages) else None
    if not isinstance(message, dict) or message.get("role") != "assistant":
        return True
    text = _text(message.get("content")).strip()
    if text and text not in output_text:
        return True
    names = [call.get("function", {}).get("name") for call in message.get("tool_calls") or [] if isinstance(call, dict)]
    return any(isinstance(name, str) and name not in output_text for name in names)


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return ""
