"""Cache stability: the prompt an agent's turn N+1 renders must extend the prompt of turn N, token for token.

Agents resend the whole conversation every turn, and a few things they send (or that a template does to them) change
text that earlier turns already rendered, so the prefix cache misses everything after it. Each rule here removes one
such cause; `normalize_for_cache` applies them all, for chat completions, messages and responses alike, and the
prefix-cache benchmark and the cache inspector name each cause they remove (server/cache/miss_causes.py):

- `strip_billing_nonce` (cause "billing_nonce"): Claude Code's first system block is a billing header,
  `x-anthropic-billing-header: cc_version=...; cc_entrypoint=...;`, to which some versions add a per-request
  `cch=<nonce>;`. The header heads the prompt, so the nonce alone makes every request a full miss. It is removed;
  the rest of the header stays (it is what the agent sent, and it is stable within a session).
- `system_messages_in_place` (cause "system_hoisted"): Claude Code puts `role: "system"` messages (an environment
  block) in the middle of the conversation. Templates that render them where they stand (Qwen) keep them there:
  the adapters never move them to the top. The DeepSeek templates hoist every system message into the head, so a
  new one mid-conversation rewrites the head (a full miss); for them such a message is rendered in place as a user
  turn instead. The Qwen3.5/3.6 template refuses a system message anywhere but first, so for it too a later one
  becomes a user turn in place (Codex's developer messages, Claude Code's environment block). The first message,
  if a system message, is still the system prompt.
"""
from __future__ import annotations

from server.rendering import Renderer

BILLING_HEADER = "x-anthropic-billing-header:"
_NONCE_KEY = "cch="


def _is_word_char(char: str) -> bool:
    return char.isalnum() or char == "_"


def _strip_nonce_in_line(line: str) -> str:
    """A billing header line without its first `cch=...;` field (one that starts a word) and the blanks before it.
    Plain string scans, each character looked at a bounded number of times: linear in the line (a regex with a lazy
    prefix and a blank run before the key backtracks quadratically on a header followed by many blanks)."""
    start = len(BILLING_HEADER)
    key = line.find(_NONCE_KEY, start)
    while key != -1 and _is_word_char(line[key - 1]):
        key = line.find(_NONCE_KEY, key + 1)
    if key == -1:
        return line
    blanks = key
    while blanks > start and line[blanks - 1] in " \t":
        blanks -= 1
    end = line.find(";", key + len(_NONCE_KEY))
    return line[:blanks] + (line[end + 1:] if end != -1 else "")


def strip_billing_nonce(text: str) -> str:
    """The text with the `cch=...;` field of a Claude Code billing header line removed (other text unchanged)."""
    if BILLING_HEADER not in text:
        return text
    return "\n".join(_strip_nonce_in_line(line) if line.startswith(BILLING_HEADER) else line
                     for line in text.split("\n"))


def _map_text(content: object, fn) -> object:
    """`content` (a string or a list of text parts) with `fn` applied to its text."""
    if isinstance(content, str):
        return fn(content)
    if isinstance(content, list):
        return [
            {**part, "text": fn(part["text"])} if isinstance(part, dict) and isinstance(part.get("text"), str)
            else part
            for part in content
        ]
    return content


def strip_billing_nonces(messages: list[dict]) -> list[dict]:
    """Every system message with its billing header's nonce stripped."""
    return [
        {**m, "content": _map_text(m.get("content"), strip_billing_nonce)}
        if isinstance(m, dict) and m.get("role") in ("system", "developer") else m
        for m in messages
    ]


def system_messages_in_place(messages: list[dict], renderer: Renderer) -> list[dict]:
    """For templates that hoist system messages or refuse them after the first: those after the first message become
    user turns where they are."""
    if not (renderer.hoists_system_messages or renderer.refuses_late_system_messages):
        return messages
    return [
        {**m, "role": "user"} if i > 0 and isinstance(m, dict) and m.get("role") in ("system", "developer") else m
        for i, m in enumerate(messages)
    ]


def normalize_for_cache(messages: list[dict], renderer: Renderer) -> list[dict]:
    """All the cache-stability rules, in order; the input is not modified."""
    if not isinstance(messages, list):
        return messages  # the renderer reports what is wrong with it
    return system_messages_in_place(strip_billing_nonces(messages), renderer)
