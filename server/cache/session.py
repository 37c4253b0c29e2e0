"""The agent session a request belongs to, as each client says it, parsed into one `session` value.

It is recorded with every request (`kvserve serve --record`), so traces can be replayed and analysed per session,
and it is what session-aware cache retention keys on. It never changes the prompt or the cache salt.

- Chat completions and responses: `prompt_cache_key` (Codex sends its thread id there).
- Messages (Claude Code): the `X-Claude-Code-Session-Id` header, else the `session_id` inside
  `metadata.user_id`, a JSON string `{"device_id": ..., "account_uuid": ..., "session_id": ...}`.
- Any API, when the above say nothing: an `X-Session-Id` header (for clients and proxies that can only add headers).
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any
from server import json_text

MAX_SESSION_CHARS = 256
CLAUDE_CODE_SESSION_HEADER = "x-claude-code-session-id"
SESSION_HEADER = "x-session-id"


def _clean(value: Any) -> str | None:
    if not isinstance(value, str) or not value.strip():
        return None
    return value.strip()[:MAX_SESSION_CHARS]


def prompt_cache_key_session(prompt_cache_key: str | None, headers: Mapping[str, str]) -> str | None:
    return _clean(prompt_cache_key) or _clean(headers.get(SESSION_HEADER))


def claude_code_session(headers: Mapping[str, str], metadata: Any) -> str | None:
    """The Claude Code session id from its header, or from `metadata.user_id`."""
    return (_clean(headers.get(CLAUDE_CODE_SESSION_HEADER)) or _metadata_session(metadata)
            or _clean(headers.get(SESSION_HEADER)))


def _metadata_session(metadata: Any) -> str | None:
    user_id = metadata.get("user_id") if isinstance(metadata, dict) else None
    if not isinstance(user_id, str):
        return None
    try:
        parsed = json_text.loads(user_id)
    except json.JSONDecodeError:
        return None
    return _clean(parsed.get("session_id")) if isinstance(parsed, dict) else None
