"""Why a prompt token missed the prefix cache: the causes' names and the rules that pick them, shared by the
prefix-cache benchmark (benchmarks/prefix/attribution.py, over simulated runs of whole workloads) and the live
cache inspector (server/inspector/, one request against its session's previous one).

Every missed token of a request (prompt - cached) gets exactly one cause. Given what the cache served, what an
unbounded cache would have served (``ideal``) and the same ignoring salts: what the ideal hits but the cache missed
was evicted; what the salt-blind ideal hits beyond the ideal was kept apart by salts. The rest is explained by
comparing the prompt with its parent's context (the previous turn's prompt and reply): the old context lost after a
divergence is charged to the change that caused it (the tool list, the system prompt, compaction, the template),
and what lies beyond the old context is new this turn.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

# How a request's context differs from its parent's: the caller changed the tool list, the system prompt or the
# history, or the messages only grew but the template rendered earlier turns differently.
CHANGE_TOOLS = "tool_list"
CHANGE_SYSTEM = "system_prompt"
CHANGE_HISTORY = "compaction"
CHANGE_CONTEXT_EDIT = "context_edit"  # the server cleared old tool results or thinking (Anthropic context_management)
CHANGE_REASONING = "template_reasoning"  # the template dropped earlier turns' reasoning (Qwen3)
CHANGE_TEMPLATE = "template"
CHANGE_BILLING_NONCE = "billing_nonce"  # Claude Code's per-request billing nonce (server/cache/normalize.py removes it)
CHANGE_SYSTEM_HOISTED = "system_hoisted"  # a new mid-conversation system message hoisted into the head (DeepSeek)
CHANGE_REPLY = "reply_changed"  # the history carries a reply other than the one the model generated
CHANGE_PROMPT = "prompt_changed"  # a raw text prompt (no messages to compare) differs from the previous one
CHANGE_IMAGE = "image_changed"  # an image's content differs where the previous prompt had one (its blocks hash it)

CAUSES: dict[str, str] = {
    "first_request": "first request of a session: nothing reusable was computed before",
    "new_tokens": "new this turn (beyond the previous context): no cache can hold them",
    "block_granularity": "partial last block of the previous context, or the last block that is always recomputed",
    "evicted": "evicted: an unbounded cache would have hit",
    "different_salt": "different cache salt: the same prefix is cached for another tenant",
    CHANGE_TOOLS: "prefix changed by the tool list (tools are rendered at the head)",
    CHANGE_SYSTEM: "prefix changed by the system prompt (edited between turns)",
    CHANGE_HISTORY: "prefix changed by compaction (history replaced by a summary: a new epoch)",
    CHANGE_CONTEXT_EDIT: "prefix changed by a context edit (the server cleared old tool results or thinking: "
                         "context_management)",
    CHANGE_REASONING: "prefix changed by the chat template: earlier turns' reasoning dropped (Qwen3 <think>)",
    CHANGE_TEMPLATE: "prefix changed by the chat template (earlier turns re-rendered differently)",
    CHANGE_BILLING_NONCE: "prefix changed by Claude Code's per-request billing nonce (removed by server/cache/normalize.py)",
    CHANGE_SYSTEM_HOISTED: "prefix changed by a new mid-conversation system message hoisted into the head (DeepSeek "
                           "templates; rendered in place by server/cache/normalize.py)",
    CHANGE_REPLY: "prefix changed by the reply: the client sent back another reply than the model generated "
                  "(an edited or replayed history)",
    CHANGE_PROMPT: "prefix changed by the client: a raw text prompt differs from the previous one",
    CHANGE_IMAGE: "image changed: an image where the previous request had another (same place, same size: the same "
                  "tokens, but its blocks hash the image's content, so they miss from its first block on)",
}
REASONING_MARKERS = ("<think>",)  # where a dropped reasoning block starts in the rendered text
_SYSTEM_ROLES = ("system", "developer")


def common_prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def miss_causes(prompt_tokens: int, cached: int, ideal: int, ideal_unsalted: int, context_tokens: int | None,
                change: str | None) -> Counter:
    """Missed prompt tokens per cause (causes with none left out).

    ``context_tokens``: how many leading prompt tokens the parent's context (prompt and reply) could have served
    (None: no parent); ``change``: why the prompt left that context before its end (None: it did not)."""
    causes: Counter = Counter()
    causes["evicted"] = max(0, ideal - cached)
    causes["different_salt"] = max(0, ideal_unsalted - ideal)
    served = max(cached, ideal, ideal_unsalted)
    rest = prompt_tokens - served
    if context_tokens is None:
        causes["first_request"] = rest
    else:
        lost = min(rest, max(0, context_tokens - served))
        causes[change or "block_granularity"] = lost
        causes["new_tokens"] = rest - lost
    return Counter({cause: n for cause, n in causes.items() if n > 0})


def message_change(history: list[dict] | None, tools: list[dict] | None, messages: list[dict] | None,
                   new_tools: list[dict] | None) -> str | None:
    """What the caller changed at the message level: ``history`` is what the parent left (its messages, and its
    reply where known), ``messages`` the new request's. None: the messages only grew and the tools are the same."""
    if (tools or None) != (new_tools or None):
        return CHANGE_TOOLS
    if not isinstance(history, list) or not isinstance(messages, list) or messages[: len(history)] == history:
        return None
    i = common_prefix(history, messages)
    if i < len(messages) and _role(history[i]) in _SYSTEM_ROLES and _role(messages[i]) == _role(history[i]):
        return CHANGE_SYSTEM
    return CHANGE_HISTORY


def _role(message: Any) -> str | None:
    return message.get("role") if isinstance(message, dict) else None


def template_change(parent_context: str, prompt: str) -> str | None:
    """For append-only messages: did re-rendering change the text the parent's context already had?"""
    n = min(len(parent_context), len(prompt))
    i = next((k for k in range(n) if parent_context[k] != prompt[k]), n)
    if i == len(parent_context):
        return None
    # The texts may agree on a marker's first characters ("<t" of "<think>" vs "<tool_call>"): look back a little.
    dropped_reasoning = any(
        -1 < parent_context.find(marker, max(0, i - len(marker) + 1)) <= i for marker in REASONING_MARKERS
    )
    return CHANGE_REASONING if dropped_reasoning else CHANGE_TEMPLATE
