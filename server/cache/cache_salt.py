"""Prefix-cache isolation between tenants: which cache salt a request's KV pages are keyed with.

Why: the timing side channel of a shared prefix cache
-----------------------------------------------------
A prefix cache makes a prompt whose beginning was seen recently much faster to answer: its first token comes back
after prefilling only the uncached suffix, and `usage.prompt_tokens_details.cached_tokens` even says how many tokens
were reused. Anyone who can send requests can therefore *probe* the cache: send a guess of another user's prompt
("system prompt of team X ... API key sk-a") and watch the time to first token (or `cached_tokens`) to learn
whether someone else recently sent exactly that prefix, one block at a time. Secrets in prompts leak that way.

The engine keys every cached block with a salt (block 0's hash includes it, so different salts never share a page).
The server chooses the salt, not the client:

- With API keys (`--api-key`, repeatable), each key is a tenant whose salt is a hash of its key. Tenants never hit
  each other's pages, so probing only reveals what the same tenant sent. The key itself is never stored.
- Without keys, every request is the same tenant (salt None): one user, or users who trust each other.
- A request's own `cache_salt` (for example one per end user behind one key) is honored only when the operator
  starts the server with `--allow-request-cache-salt`, and even then it is scoped inside the tenant's salt, so a
  client cannot pick another tenant's salt. Without that flag a request carrying `cache_salt` is refused with a 400
  rather than silently ignored, so a client never believes it is isolated when it is not.

The price of isolation is hit rate: identical prefixes of different tenants are computed and cached once per tenant.
"""
from __future__ import annotations

import hashlib

from server.api.protocol import APIError


def tenant_salt(api_key: str | None) -> str | None:
    """The salt of the tenant holding `api_key`; None when the server runs without keys (one shared tenant)."""
    if api_key is None:
        return None
    return hashlib.sha256(b"kvserve-tenant\0" + api_key.encode("utf-8")).hexdigest()[:32]


def salt_tenant(salt: str | None) -> str | None:
    """The tenant an effective salt belongs to (what `tenant_salt` gave; None: the server has no keys)."""
    if salt is None or ":" not in salt:  # a tenant's salt is hex: a colon means a request's salt scoped inside it
        return salt
    length, _, rest = salt.partition(":")
    return rest[: int(length)] or None


def effective_salt(tenant: str | None, requested: str | None, allow_request_salt: bool) -> str | None:
    """The salt the engine keys this request's pages with."""
    if requested is None:
        return tenant
    if not allow_request_salt:
        raise APIError(
            400,
            "cache_salt is not accepted by this server (the operator did not start it with "
            "--allow-request-cache-salt); prefix-cache isolation is per API key",
            param="cache_salt",
            code="cache_salt_not_allowed",
        )
    # Length-prefixed, so that ("ab", "c") and ("a", "bc") can never collide.
    scope = tenant or ""
    return f"{len(scope)}:{scope}:{requested}"
