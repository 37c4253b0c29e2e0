"""Per-tenant budgets, so that one tenant (an API key; server/cache/cache_salt.py) cannot starve another of the engine's
slots or of the server's stored state: how many sequences it has in the engine at once (running or queued: past it,
a 429 naming the flag), how many `store: true` responses it keeps (its own oldest are forgotten first, never another
tenant's), and how many named caches it holds. Without API keys the server has one tenant, bounded the same way.
Each bound is a `kvserve serve` flag (docs/SERVER.md, "Limits").
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from server.cache.cache_salt import salt_tenant
from server.api.protocol import APIError


def _flag(name: str, help_text: str, kind: type | None = None) -> dict:
    """A field's flag; ``kind``: its type where the default (None) does not tell it."""
    return {"flag": name, "help": help_text, **({"type": kind} if kind else {})}


@dataclass(frozen=True)
class TenantLimits:
    """Each field's ``metadata`` names its `kvserve serve` flag (server/cli/serve.py builds them from it)."""

    sequences: int | None = field(default=None, metadata=_flag(
        "--max-sequences-per-tenant", "most sequences one tenant has in the engine at once, running or queued; a "
        "request beyond it gets 429 (default: half of --max-num-seqs when the server has two or more keys, so that "
        "another tenant always finds a running slot; with one tenant, four times --max-num-seqs)", int))
    stored_responses: int = field(default=1024, metadata=_flag(
        "--max-stored-responses-per-tenant", "stored Responses (store: true) kept per tenant for previous_response_id; "
        "a tenant's oldest are forgotten first"))
    named_caches: int = field(default=64, metadata=_flag(
        "--max-named-caches-per-tenant", "named caches (/v1/caches) one tenant may hold at once; another gets 429"))
    named_cache_share: float = field(default=0.25, metadata=_flag(
        "--max-named-cache-share", "the largest fraction of the KV pool one tenant's named caches may pin together "
        "(the engine retains at most --max-retained-fraction for everyone); a cache beyond it gets 429"))

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value is not None and value <= 0:
                raise ValueError(f"tenant limit {name} must be positive, got {value}")
        if self.named_cache_share > 1:
            raise ValueError(f"named_cache_share is a fraction of the KV pool, at most 1, got {self.named_cache_share}")


def sequences_per_tenant(limits: TenantLimits, num_keys: int, max_num_seqs: int) -> int:
    """The operator's `--max-sequences-per-tenant`, else its default: half the engine's running slots when there
    are several tenants (one tenant's requests, however many, leave the other half to the rest), four times them
    (a queue's worth) when there is one."""
    if limits.sequences is not None:
        return limits.sequences
    return max(1, max_num_seqs // 2) if num_keys >= 2 else 4 * max_num_seqs


class TenantSlots:
    """Sequences each tenant has in the engine. `acquire` before a submit returns the release (idempotent), to run
    when the request's stream closes. Called on the event loop; locked anyway (cheap)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._held: dict[str | None, int] = {}
        self._lock = threading.Lock()

    def acquire(self, salt: str | None, sequences: int) -> Callable[[], None]:
        tenant = salt_tenant(salt)
        if sequences > self.limit:
            raise APIError(400, f"the request runs {sequences} sequences; one API key may have at most {self.limit} "
                           "in the engine at once (--max-sequences-per-tenant)", param="n", code="limit_exceeded")
        with self._lock:
            held = self._held.get(tenant, 0)
            if held + sequences > self.limit:
                raise APIError(429, f"this API key has {held} sequences running or queued and the request adds "
                               f"{sequences}; at most {self.limit} at once (--max-sequences-per-tenant): retry when "
                               "some have finished", type="rate_limit_error", code="tenant_sequences_exceeded")
            self._held[tenant] = held + sequences
        released = False

        def release() -> None:
            nonlocal released
            with self._lock:
                if released:
                    return
                released = True
                left = self._held[tenant] - sequences
                if left:
                    self._held[tenant] = left
                else:
                    del self._held[tenant]
        return release

    def held(self, salt: str | None) -> int:
        with self._lock:
            return self._held.get(salt_tenant(salt), 0)
