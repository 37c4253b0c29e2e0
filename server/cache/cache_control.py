"""Prompt-cache breakpoints: `cache_control` marks on Anthropic Messages blocks (tools, system, message content) and
on chat content parts (as OpenRouter-style clients send them), turned into engine pins.

A mark says "cache the prompt up to and including this block" with a lifetime, `{"type": "ephemeral"}` (5
minutes) or `{"type": "ephemeral", "ttl": "1h"}`. kvserve caches every full block anyway; a breakpoint pins the
blocks up to it (`engine.retention.CachePin`): they are evicted only after every unpinned block, and each hit
renews the TTL. Anthropic's prefix order is tools, system, messages; the chat templates render the tools inside the
system turn, so a breakpoint on a tool or on the system prompt covers both.

Where a breakpoint falls in tokens: the request is cut right after the marked block and rendered without a
generation prompt; the breakpoint is the number of leading prompt tokens that cut rendering shares with the full
prompt. Whatever a template does at the cut, the pin never covers a token the full prompt does not have.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from engine.retention import DEFAULT_TTL, TTL_CHOICES, CachePin
from server.api.protocol import APIError

MAX_BREAKPOINTS = 4  # as Anthropic allows
T = TypeVar("T")


@dataclass(frozen=True)
class Breakpoint:
    """The chat conversation (messages, tools) cut right after a marked block, and the mark's TTL."""

    messages: list[dict]
    tools: list[dict] | None
    ttl_s: float


def parse_cache_control(mark: Any, where: str) -> float | None:
    """The TTL in seconds of a `cache_control` value (None: no mark); a malformed one is a 400."""
    if mark is None:
        return None
    if not isinstance(mark, dict) or mark.get("type") != "ephemeral":
        raise APIError(400, f"{where}: cache_control must be {{\"type\": \"ephemeral\"}} (with an optional ttl)",
                       param=where)
    ttl = mark.get("ttl", DEFAULT_TTL)
    if ttl not in TTL_CHOICES:
        raise APIError(400, f"{where}: cache_control.ttl must be one of {', '.join(map(repr, TTL_CHOICES))}",
                       param=where)
    return TTL_CHOICES[ttl]


def mark_ttl(block: Any, where: str) -> float | None:
    """The TTL of the `cache_control` mark on a block or message (None: unmarked)."""
    if not isinstance(block, dict):
        return None
    return parse_cache_control(block.get("cache_control"), f"{where}.cache_control")


def counted(marks: Iterable[tuple[T, float | None]]) -> list[tuple[T, float]]:
    """The marked places (with their TTLs) among ``marks``, counted before any breakpoint is built: a cut copies
    the conversation up to its mark, so building a breakpoint per mark first was quadratic in the marks (20,000
    marked parts: 11 s and 1.4 GB before the 400)."""
    found = [(where, ttl) for where, ttl in marks if ttl is not None]
    if len(found) > MAX_BREAKPOINTS:
        raise APIError(400, f"a request may carry at most {MAX_BREAKPOINTS} cache_control breakpoints, this one has "
                            f"{len(found)}", param="cache_control")
    return found


def chat_breakpoints(messages: list[dict], tools: list[dict] | None) -> list[Breakpoint]:
    """Marks on chat content parts (and on whole messages, as some clients put them)."""
    def marks() -> Iterator[tuple[tuple[int, int | None], float | None]]:
        for i, message in enumerate(messages):
            if not isinstance(message, dict):
                continue
            content = message.get("content")
            if isinstance(content, list):
                for j, part in enumerate(content):
                    yield (i, j), mark_ttl(part, f"messages.{i}.content.{j}")
            yield (i, None), mark_ttl(message, f"messages.{i}")

    points = []
    for (i, j), ttl in counted(marks()):
        if j is None:
            points.append(Breakpoint(messages[: i + 1], tools, ttl))
        else:
            message = messages[i]
            points.append(Breakpoint([*messages[:i], {**message, "content": message["content"][: j + 1]}], tools, ttl))
    return points


Render = Callable[[list[dict], list[dict] | None], str]  # (messages, tools) -> prompt text, no generation prompt


def shared_prefix_tokens(messages: list[dict], tools: list[dict] | None, prompt_text: str, prompt_ids: list[int],
                         render: Render, encode: Callable[[str], list[int]]) -> int:
    """How many leading prompt tokens the conversation cut to ``messages`` (and ``tools``) shares with the full
    prompt: 0 when the template cannot render the cut alone (tools without any message)."""
    try:
        text = render(messages, tools)
    except ValueError:
        return 0
    shared = encode(prompt_text[: len(os.path.commonprefix([prompt_text, text]))])
    n = 0
    while n < min(len(shared), len(prompt_ids)) and shared[n] == prompt_ids[n]:
        n += 1
    return n


def breakpoint_pins(points: list[Breakpoint], prompt_text: str, prompt_ids: list[int], render: Render,
                    encode: Callable[[str], list[int]]) -> tuple[CachePin, ...]:
    """Each breakpoint as a pin on the leading prompt tokens its cut rendering shares with the full prompt."""
    pins = []
    for point in points:
        n = shared_prefix_tokens(point.messages, point.tools, prompt_text, prompt_ids, render, encode)
        if n:
            pins.append(CachePin(n, point.ttl_s))
    return tuple(pins)


# A character no template writes after a message's content: a conversation cut whose last message ends with it
# shares the prompt exactly up to the end of that message's content.
CONTENT_END = "\ue000"


def _with_content_end(message: dict) -> dict:
    content = message.get("content")
    if isinstance(content, list):
        return {**message, "content": [*content, {"type": "text", "text": CONTENT_END}]}
    return {**message, "content": (content or "") + CONTENT_END}


def snapshot_hints(messages: list[dict], tools: list[dict] | None, prompt_text: str, prompt_ids: list[int],
                   render: Render, encode: Callable[[str], list[int]]) -> tuple[int, ...]:
    """Hybrid models: the message boundaries (prompt token counts) where the recurrent state is worth a snapshot
    (engine/kv/snapshot_policy.py): the end of the leading system messages and the tools, where subagents and new
    sessions branch off; the start of the last user turn, which agents rewrite (Claude Code's reminders); and the
    end of that turn's content when messages other than replies follow it: a client retries a request by appending
    to its last user message (Claude Code, after a reply with no visible output), so the retry branches off there,
    before Claude Code's environment message. Where the user message ends the prompt, the prompt's end (a few tokens
    on) is kept anyway; where a reply follows, the request is a later turn and its retry branches off near its end."""
    lead = 0
    while lead < len(messages) and messages[lead].get("role") in ("system", "developer"):
        lead += 1
    # The head cut ends with an empty user turn: some templates (Qwen3.6) render nothing without a user query, and
    # the shared text then runs to that turn's header, where every conversation with this head continues alike
    cuts = [[*messages[:lead], {"role": "user", "content": ""}]] if lead or tools else []
    last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=None)
    if last_user is not None:
        if last_user > lead:
            cuts.append(messages[:last_user])
        if last_user < len(messages) - 1 and all(m.get("role") != "assistant" for m in messages[last_user:]):
            cuts.append([*messages[:last_user], _with_content_end(messages[last_user])])
    hints = {shared_prefix_tokens(cut, tools, prompt_text, prompt_ids, render, encode) for cut in cuts}
    return tuple(sorted(hints - {0}))
