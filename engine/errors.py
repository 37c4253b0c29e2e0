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


class EngineDeadError(RuntimeError):
    """The engine failed (or stopped) while a request needed it; the request cannot finish."""


class FatalEngineError(RuntimeError):
    """The engine cannot go on (a step failing this way is not one bad batch): it stops, and a server exits."""


class WorkerDiedError(FatalEngineError):
    """A tensor-parallel worker process died; the message carries its own error (or the signal that killed it)."""


class ParallelConfigError(ValueError):
    """A tensor-parallel size this model's shape or this machine's devices cannot take."""
