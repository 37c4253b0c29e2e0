"""Remote compaction for the Responses API: the summary turn, its sealed `compaction` item, and the item's expansion.

Two forms ask for one (docs/SERVER.md, "Remote compaction"):
- a `/v1/responses` request whose `input` ends with `{"type": "compaction_trigger"}` (Codex's built-in `openai`
  provider, codex-rs `compact_remote_v2.rs`): its output is exactly one `compaction` item;
- `POST /v1/responses/compact` (the OpenAI SDK's `responses.compact`): its output is the conversation's user messages
  (the most recent within `RETAINED_TOKENS`) followed by one `compaction` item.

The summary turn is the request's own conversation (instructions, tools, history: the prompt the agent's last turn
sent, so it reads from the prefix cache) plus one user message asking for a summary (`COMPACTION_PROMPT`). The
summary is sealed (`CompactionSealer`) into the item's `encrypted_content`: AES-256-GCM under a key derived from the
server's compaction key and the tenant (the API key's salt), so the item reveals nothing without the key, and a
tampered item or another tenant's fails to open (a 400). A later request that carries the item gets, in its place,
one user message: `SUMMARY_PREFIX` and the summary. The head of the prompt (instructions, tools) is never touched,
so the request after a compaction reads it from the cache; the history after it is a new epoch, sealed into the item
(`Summary.epoch`) and shown by the cache inspector.

The same summary turn serves Anthropic's `compact_20260112` (server/api/messages_compaction.py) and a Responses
request's automatic compaction (`context_management` `compact_threshold`): there the reply follows in the same request,
a second generation (`continue_after`) over the compacted conversation, whose head the summary turn just read.
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from server.api.protocol import APIError
from server.pipeline.async_engine import RequestStream
from server.pipeline.choices import ChoiceState, choice_states, parsed_updates
from server.pipeline.context import ServingContext
from server.pipeline.generation import Generation, submit
from server.pipeline.plan import Plan, record_plan

COMPACTION_PROMPT = (
    "Stop working on the task for a moment: the conversation above is about to be replaced by a summary of it. "
    "Write that summary now, for the assistant who will carry on from it with nothing else to go by: the goal and "
    "the user's requirements, what has been done and decided so far (files, commands, results), what is still open, "
    "and the next concrete steps. Keep names, paths and values exact. Answer with the summary only."
)
SUMMARY_PREFIX = (
    "The conversation before this point was compacted. This is the summary written at that point; continue the task "
    "from it:\n"
)
TRIGGER_TYPE = "compaction_trigger"
ITEM_TYPE = "compaction"
RETAINED_TOKENS = 64_000  # user messages kept by /v1/responses/compact (estimated at 4 bytes a token, as codex-rs does)
DEFAULT_THRESHOLD_SHARE = 0.9  # of the context: a `compaction` entry's threshold when it names none
SUMMARY_MAX_TOKENS = 2048  # the summary turn's output, when the request sets no max_output_tokens
KEY_ENV = "KVSERVE_COMPACTION_KEY"
_VERSION = b"kvc1"
T = TypeVar("T")
_NONCE_BYTES = 12


@dataclass(frozen=True)
class Summary:
    """What a compaction item holds: the summary text and the epoch it starts (1 for a conversation's first)."""

    text: str
    epoch: int


class CompactionSealer:
    """Seals summaries into opaque `encrypted_content` strings and opens them again, per tenant.

    ``key``: the operator's compaction key (`--compaction-key` or KVSERVE_COMPACTION_KEY: items survive a restart);
    None draws a random one (items die with the process). Each tenant's items are sealed under HMAC-SHA256(key,
    tenant), so one tenant's item does not open under another's key."""

    def __init__(self, key: str | None = None) -> None:
        self._key = hashlib.sha256(key.encode()).digest() if key else os.urandom(32)

    def _aead(self, tenant: str | None) -> AESGCM:
        return AESGCM(hmac.new(self._key, b"kvserve-compaction\0" + (tenant or "").encode(), "sha256").digest())

    def seal(self, tenant: str | None, summary: Summary) -> str:
        nonce = os.urandom(_NONCE_BYTES)
        plain = json.dumps({"summary": summary.text, "epoch": summary.epoch}).encode()
        sealed = self._aead(tenant).encrypt(nonce, plain, _VERSION)
        return (_VERSION + b"." + base64.urlsafe_b64encode(nonce + sealed).rstrip(b"=")).decode()

    def open(self, tenant: str | None, content: object, param: str) -> Summary:
        """The summary sealed in ``content``; a 400 naming ``param`` when it is not an item this server sealed for
        this tenant (tampered, another tenant's, or sealed under another key)."""
        refused = APIError(400, f"{param}: the compaction item was not made by this server for this API key (it was "
                                "altered, belongs to another key, or was sealed under another --compaction-key)",
                           param=param, code="invalid_compaction_item")
        if not isinstance(content, str) or not content.startswith(_VERSION.decode() + "."):
            raise refused
        body = content[len(_VERSION) + 1:]
        try:
            raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
            plain = self._aead(tenant).decrypt(raw[:_NONCE_BYTES], raw[_NONCE_BYTES:], _VERSION)
            payload = json.loads(plain)
            return Summary(str(payload["summary"]), int(payload["epoch"]))
        except (ValueError, InvalidTag, KeyError, TypeError):
            raise refused from None


def compaction_item(encrypted_content: str) -> dict:
    """The `compaction` output item."""
    return {"id": f"cmp_{secrets.token_hex(12)}", "type": ITEM_TYPE, "encrypted_content": encrypted_content}


def summary_message(summary: Summary) -> dict:
    """The chat message a compaction item stands for in a later request."""
    return {"role": "user", "content": SUMMARY_PREFIX + summary.text}


def auto_compact_threshold(config: object, max_model_len: int) -> int | None:
    """A Responses request's `context_management` (`[{"type": "compaction", "compact_threshold": N}]`): the
    rendered input's length in tokens past which it is compacted first (no threshold given:
    `DEFAULT_THRESHOLD_SHARE` of the context); None without a compaction entry. Anything else is a 400."""
    if config is None:
        return None
    if not isinstance(config, list):
        raise APIError(400, "context_management must be a list of entries", param="context_management")
    threshold = None
    for i, entry in enumerate(config):
        where = f"context_management.{i}"
        if not isinstance(entry, dict) or entry.get("type") != ITEM_TYPE:
            raise APIError(400, f"{where}: the entry type must be 'compaction' (the only one)", param=f"{where}.type")
        value = entry.get("compact_threshold")
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise APIError(400, f"{where}.compact_threshold must be a positive integer",
                           param=f"{where}.compact_threshold")
        threshold = value if value is not None else int(max_model_len * DEFAULT_THRESHOLD_SHARE)
    return threshold


def has_trigger(items: object) -> bool:
    """The input asks for a compaction (its last item is a `compaction_trigger`)."""
    return isinstance(items, list) and bool(items) and isinstance(items[-1], dict) \
        and items[-1].get("type") == TRIGGER_TYPE


def retained_user_messages(items: str | list[dict]) -> list[dict]:
    """The input's user messages as output items, the most recent within `RETAINED_TOKENS` (what
    `responses.compact` returns before its compaction item)."""
    texts = [items] if isinstance(items, str) else [
        _message_text(item) for item in items
        if isinstance(item, dict) and item.get("type", "message") == "message" and item.get("role") == "user"]
    kept: list[str] = []
    budget = RETAINED_TOKENS * 4
    for text in reversed(texts):
        budget -= len(text.encode())
        if budget < 0:
            break
        kept.append(text)
    return [{"id": f"msg_{secrets.token_hex(12)}", "type": "message", "role": "user", "status": "completed",
             "content": [{"type": "input_text", "text": text}]} for text in reversed(kept)]


def _message_text(item: dict) -> str:
    content = item.get("content")
    if isinstance(content, str):
        return content
    parts = content if isinstance(content, list) else []
    return "".join(p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str))


def summary_text(state: ChoiceState) -> str:
    """What a summary turn wrote: its answer (its text without the thinking)."""
    return state.message()["content"] or state.output.text


async def finished_state(ctx: ServingContext, plan: Plan, stream: RequestStream) -> ChoiceState:
    """A one-choice plan's choice, once its output has ended (recorded)."""
    [state] = states = choice_states(ctx, plan, streaming=False)
    try:
        async for _ in parsed_updates(ctx, plan, stream, states):
            pass
    finally:
        record_plan(ctx, plan)
    return state


async def continue_after(ctx: ServingContext, stream: RequestStream, plan: Callable[[], T],
                         generation: Callable[[T], Generation]) -> tuple[T, RequestStream]:
    """A second generation in the request whose first one (``stream``) has ended: planned on a prepare lane and
    submitted. ``stream`` is closed now (its tenant slot and holds settled) and closes the new stream when the route
    handler closes it, however the response ends (a client that leaves aborts the second generation too)."""
    stream.abort()
    planned = await ctx.prepare(plan)
    second = await submit(ctx, [generation(planned)])
    stream.on_close(second.abort)
    return planned, second
