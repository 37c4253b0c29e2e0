"""Why the engine refuses a request, as types: callers map them to their own errors (the server to HTTP 400s with
an OpenAI error code) without reading messages."""
from __future__ import annotations


class RequestRejected(ValueError):
    """A request that can never run as given (bad input); nothing of it entered the engine."""

    code: str | None = None  # a machine-readable reason, for API error bodies


class PromptTooLongError(RequestRejected):
    """The prompt leaves no room in the context for a generated token."""

    code = "context_length_exceeded"


class KVCacheTooSmallError(RequestRejected):
    """The prompt needs more KV blocks than the whole pool has."""

    code = "kv_cache_too_small"
