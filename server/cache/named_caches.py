"""Named caches (`/v1/caches`, Gemini-style cached content): a prefix of messages and tools, prefilled once, pinned,
and referenced by name.

- `POST /v1/caches` `{name, model, messages, tools, ttl}` renders the messages (no generation prompt), prefills
  them with a one-token request whose whole prompt is a breakpoint with the cache's TTL (`5m`, `1h` or seconds),
  and returns the prefix's token count.
- A chat or messages request with `cached_content: NAME` continues it: the cache's messages come first, its tools
  apply (a request may not bring other tools). A request whose prompt merely starts with the same prefix hits the
  same pinned blocks through the prefix cache.
- `GET /v1/caches` lists the caller's caches, `GET /v1/caches/{name}` shows one (with how many of its tokens the
  cache holds right now), `DELETE /v1/caches/{name}` unpins and forgets it.

Names live per tenant (the cache salt, server/cache/cache_salt.py): a tenant neither sees nor uses another's caches. An
entry lapses `ttl` after it was last used by name; its pinned blocks follow the same TTL, renewed on every hit.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace
from typing import Any

from pydantic import Field

from engine.retention import TTL_CHOICES
from server.cache.cache_control import Breakpoint
from server.cache.cache_salt import salt_tenant
from server.api.protocol import APIError, RequestModel
from server.pipeline.turn import Turn

MAX_TTL_S = 24 * 3600.0


class CreateCacheRequest(RequestModel):
    # At least one character that is not a dot: "." and ".." are path segments that clients normalize away, so
    # such a cache could never be shown or deleted at /v1/caches/{name}.
    name: str = Field(pattern=r"^[A-Za-z0-9._-]*[A-Za-z0-9_-][A-Za-z0-9._-]*$", max_length=128)
    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    ttl: str | float = "5m"  # "5m", "1h", or seconds
    chat_template_kwargs: dict[str, Any] | None = None

    def ttl_seconds(self) -> float:
        seconds = TTL_CHOICES.get(self.ttl) if isinstance(self.ttl, str) else float(self.ttl)
        if seconds is None or not 0 < seconds <= MAX_TTL_S:
            raise APIError(400, f"ttl must be '5m', '1h' or seconds in (0, {MAX_TTL_S:.0f}]", param="ttl")
        return seconds


@dataclass
class NamedCache:
    name: str
    salt: str | None
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    ttl_s: float
    token_ids: list[int]
    created: float
    last_used: float

    @property
    def expires_at(self) -> float:
        return self.last_used + self.ttl_s

    def card(self, cached_tokens: int | None = None) -> dict[str, Any]:
        card = {"object": "cache", "name": self.name, "tokens": len(self.token_ids), "ttl_seconds": self.ttl_s,
                "created": int(self.created), "expires_at": int(self.expires_at)}
        if cached_tokens is not None:
            card["cached_tokens"] = cached_tokens
        return card

    def continue_with(self, turn: Turn) -> Turn:
        """``turn`` after the cache's messages, its breakpoints likewise, plus a breakpoint at the cache's end."""
        if turn.tools is not None and turn.tools != self.tools:
            raise APIError(400, f"cache {self.name!r} fixes the tools; send the request without 'tools'",
                           param="tools")
        shifted = [Breakpoint([*self.messages, *p.messages], self.tools, p.ttl_s) for p in turn.breakpoints or []]
        return replace(turn, messages=[*self.messages, *turn.messages], tools=self.tools,
                       breakpoints=[Breakpoint(self.messages, self.tools, self.ttl_s), *shifted])


class NamedCaches:
    """The registry, per tenant salt. Used from the prepare thread and the event loop, hence the lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._caches: dict[tuple[str | None, str], NamedCache] = {}

    def _live(self, salt: str | None, name: str) -> NamedCache | None:
        cache = self._caches.get((salt, name))
        if cache is not None and cache.expires_at <= time.time():
            del self._caches[salt, name]
            return None
        return cache

    def _found(self, salt: str | None, name: str) -> NamedCache:
        cache = self._live(salt, name)
        if cache is None:
            raise APIError(404, f"there is no cache named {name!r}; create it with POST /v1/caches",
                           param="cached_content", code="cache_not_found")
        return cache

    def get(self, salt: str | None, name: str) -> NamedCache:
        """The cache, or a 404."""
        with self._lock:
            return self._found(salt, name)

    def use(self, salt: str | None, name: str) -> NamedCache:
        """The cache a request continues (its lifetime restarts), or a 404."""
        with self._lock:
            cache = self._found(salt, name)
            cache.last_used = time.time()
            return cache

    def check_free(self, salt: str | None, name: str) -> None:
        with self._lock:
            if self._live(salt, name) is not None:
                raise APIError(409, f"a cache named {name!r} exists; delete it first", param="name",
                               code="cache_exists")

    def check_budget(self, salt: str | None, tokens: int, max_caches: int, max_tokens: int) -> None:
        """429 when one more cache of ``tokens`` would take the tenant (the API key behind ``salt``) past its share:
        ``max_caches`` caches, ``max_tokens`` pinned tokens together (so one tenant's long-lived caches cannot take
        the whole retention cap from the others)."""
        with self._lock:
            self._check_budget(salt, tokens, max_caches, max_tokens)

    def _check_budget(self, salt: str | None, tokens: int, max_caches: int, max_tokens: int) -> None:
        tenant = salt_tenant(salt)
        held = [c for (s, name) in list(self._caches) if salt_tenant(s) == tenant
                and (c := self._live(s, name)) is not None]
        if len(held) >= max_caches:
            raise APIError(429, f"this API key holds {len(held)} named caches; at most {max_caches} "
                           "(--max-named-caches-per-tenant): delete one first", type="rate_limit_error",
                           code="named_caches_exceeded")
        pinned = sum(len(c.token_ids) for c in held)
        if pinned + tokens > max_tokens:
            raise APIError(429, f"this API key's named caches pin {pinned} tokens and this one {tokens}; together at "
                           f"most {max_tokens} (--max-named-cache-share of the KV pool): delete one first",
                           type="rate_limit_error", code="named_caches_exceeded")

    def add(self, cache: NamedCache, max_caches: int | None = None, max_tokens: int | None = None) -> None:
        with self._lock:
            if self._live(cache.salt, cache.name) is not None:  # created meanwhile by a concurrent request
                raise APIError(409, f"a cache named {cache.name!r} exists; delete it first", param="name",
                               code="cache_exists")
            if max_caches is not None and max_tokens is not None:  # again: concurrent creates passed the first check
                self._check_budget(cache.salt, len(cache.token_ids), max_caches, max_tokens)
            self._caches[cache.salt, cache.name] = cache

    def remove(self, salt: str | None, name: str) -> NamedCache:
        with self._lock:
            cache = self._found(salt, name)
            del self._caches[salt, name]
            return cache

    def list(self, salt: str | None) -> list[NamedCache]:
        with self._lock:
            return [c for (s, name) in list(self._caches) if s == salt and (c := self._live(s, name)) is not None]
