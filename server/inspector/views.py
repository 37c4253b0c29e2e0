"""The inspector's JSON: what the page and `kvserve inspect` show, cut to what the viewer may see.

A viewer is a tenant (an API key; the hash of it, as the cache salt) or an operator (`--operator-key`: every
tenant). A tenant sees its own sessions and requests and the cache's totals; anything else is answered as if it did
not exist. Without API keys the server has one tenant, and everyone sees everything.
"""
from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.kv.blocks import CachedPrefix
from engine.outputs import SchedulerStats
from server.inspector.prompt_trie import unpack
from server.inspector.store import TIMELINE_COLUMNS, CacheSample, InspectedRequest, Inspector, Session
from server.pipeline.logprobs import TokenTexts
from server.cache.miss_causes import CAUSES

TENANT_CHARS = 12  # how much of a tenant's hash is shown
# What a tenant sees of the cache: the tiers' sizes now, fixed by the operator (what is used, cached or evicted, and
# when the samples were taken -- while the cache changes -- depend on every tenant's requests: operators only).
TENANT_TIMELINE_COLUMNS = ("device_total", "host_total", "disk_total")
SIDE_BY_SIDE_TOKENS = 48  # tokens shown on each side of a divergence


@dataclass(frozen=True)
class Viewer:
    tenant: str | None  # None: the server has no API keys
    operator: bool = False

    def sees(self, tenant: str | None) -> bool:
        return self.operator or tenant == self.tenant

    @property
    def sees_all(self) -> bool:
        """An operator, or anyone on a server without keys (one tenant)."""
        return self.operator or self.tenant is None

    def describe(self) -> dict[str, Any]:
        return {"tenant": short_tenant(self.tenant), "operator": self.operator}


def short_tenant(tenant: str | None) -> str | None:
    return tenant[:TENANT_CHARS] if tenant else None


def visible_session(inspector: Inspector, viewer: Viewer, key: str) -> Session | None:
    session = inspector.sessions.get(key)
    return session if session is not None and viewer.sees(session.tenant) else None


def visible_request(inspector: Inspector, viewer: Viewer, request_id: str) -> InspectedRequest | None:
    record = inspector.by_id.get(request_id)
    return record if record is not None and viewer.sees(record.session.tenant) else None


def request_summary(r: InspectedRequest) -> dict[str, Any]:
    divergence = r.divergence
    return {
        "id": r.request_id, "time": r.time, "endpoint": r.endpoint, "session": r.session.key,
        "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens, "cached_tokens": r.cached_tokens,
        "cached": {"device": r.device_cached_tokens, "host": r.host_cached_tokens, "disk": r.disk_cached_tokens},
        "ideal_tokens": r.ideal_tokens, "queue_s": r.queue_s, "ttft_s": r.ttft_s, "e2e_s": r.e2e_s,
        "finish_reason": r.finish_reason, "parent": r.parent_id, "misses": r.misses, "epoch": r.epoch,
        "breakpoints": [{"tokens": n, "ttl_s": ttl} for n, ttl in r.breakpoints],
        "divergence": None if divergence is None else {
            "index": divergence.index, "cause": divergence.cause, "description": CAUSES[divergence.cause],
            "in_reply": divergence.in_reply},
    }


def session_summary(s: Session) -> dict[str, Any]:
    requests = s.requests
    prompt = sum(r.prompt_tokens for r in requests)
    cached = sum(r.cached_tokens for r in requests)
    return {
        "id": s.key, "client_id": s.client_id, "tenant": short_tenant(s.tenant), "requests": len(requests),
        "first_time": requests[0].time, "last_time": requests[-1].time, "prompt_tokens": prompt,
        "cached_tokens": cached, "hit_rate": cached / prompt if prompt else 0.0,
        "hit_rates": [round(r.cached_tokens / r.prompt_tokens, 4) if r.prompt_tokens else 0.0 for r in requests],
        "divergences": sum(r.divergence is not None for r in requests),
    }


def sessions_view(inspector: Inspector, viewer: Viewer) -> dict[str, Any]:
    with inspector.lock:
        visible = [s for s in inspector.sessions.values() if viewer.sees(s.tenant)]
        sessions = [session_summary(s) for s in visible]
        kept = len(inspector.ring) if viewer.sees_all else sum(len(s.requests) for s in visible)
        return {"model": inspector.model_name, "block_size": inspector.block_size, "viewer": viewer.describe(),
                "max_requests": inspector.max_requests, "requests_kept": kept,
                "causes": CAUSES, "sessions": sorted(sessions, key=lambda s: -s["last_time"])}


def session_view(inspector: Inspector, session: Session) -> dict[str, Any]:
    with inspector.lock:
        return {"model": inspector.model_name, "session": session_summary(session),
                "requests": [request_summary(r) for r in session.requests]}


def prompt_block_hashes(inspector: Inspector, record: InspectedRequest) -> list[bytes]:
    """The engine's hashes of the request's full prompt blocks (its sequence's path in the trie)."""
    with inspector.lock:
        path = record.end.path() if record.end is not None else []
        return [node.block_hash for node in path[: record.prompt_tokens // inspector.block_size]]


def request_view(inspector: Inspector, record: InspectedRequest, texts: TokenTexts,
                 blocks_now: Sequence[str | None], snapshot_points: Sequence[int] = ()) -> dict[str, Any]:
    """The request's prompt as token texts, with what the cache served (by tier), what the cache holds of each
    prompt block now (``blocks_now``: `KVCacheManager.where_cached`) and where a hybrid model's prompt can resume
    now (``snapshot_points``: `KVCacheManager.snapshot_points`), and its divergence side by side."""
    with inspector.lock:
        prompt = unpack(inspector.trie.sequence(record.end, record.tail), 0, record.prompt_tokens)
        parent = inspector.by_id.get(record.parent_id) if record.parent_id else None
        parent_context = inspector.trie.sequence(parent.end, parent.tail) if parent is not None else None
        view = {"model": inspector.model_name, "block_size": inspector.block_size, "request": request_summary(record),
                "session": session_summary(record.session)}
    device, host = record.device_cached_tokens, record.host_cached_tokens
    view.update({
        "token_ids": prompt,
        "pieces": token_pieces(texts, prompt),
        "cached_ranges": {"device": [0, device], "host": [device, device + host],
                          "disk": [device + host, record.cached_tokens]},
        "blocks_now": list(blocks_now),
        "snapshot_points": list(snapshot_points),
        "side_by_side": None,
    })
    divergence = record.divergence
    if divergence is not None and parent is not None and parent_context is not None:
        start = max(0, divergence.index - SIDE_BY_SIDE_TOKENS)
        end = divergence.index + SIDE_BY_SIDE_TOKENS
        view["side_by_side"] = {
            "previous": {"id": parent.request_id, "start": start, "reply_from": parent.prompt_tokens,
                         "pieces": token_pieces(texts, unpack(parent_context, start, end))},
            "current": {"id": record.request_id, "start": start, "pieces": token_pieces(texts, prompt[start:end])},
        }
    return view


def token_pieces(texts: TokenTexts, token_ids: Sequence[int]) -> list[str]:
    """Each token's text; a character split across tokens shows on the token that completes it."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    return [decoder.decode(bytes(texts.get(t)[1])) for t in token_ids]


def cache_view(inspector: Inspector, viewer: Viewer, prefixes: list[CachedPrefix], now_monotonic: float,
               limit: int) -> dict[str, Any]:
    """The cache's blocks per tier over time, evictions by cause, and the largest cached prefixes with who holds
    them (only the viewer's own, unless an operator asks)."""
    with inspector.lock:
        samples = list(inspector.timeline)
        last = inspector.latest_stats
        largest = []
        for prefix in prefixes:
            holder = _holder(inspector, prefix)
            tenant = holder.session.tenant if holder is not None else None
            if not viewer.sees_all and (holder is None or not viewer.sees(tenant)):
                continue
            largest.append({
                "blocks": len(prefix.block_hashes), "tokens": len(prefix.block_hashes) * inspector.block_size,
                "referenced_blocks": prefix.num_referenced, "retained_blocks": prefix.num_retained,
                "retained_for_s": max(0.0, prefix.retained_until - now_monotonic) if prefix.retained_until else 0.0,
                "holder": None if holder is None else {
                    "request": holder.request_id, "session": holder.session.key, "tenant": short_tenant(tenant),
                    "client_id": holder.session.client_id},
            })
            if len(largest) == limit:
                break
        if viewer.sees_all:
            kept = {"requests": len(inspector.ring), "max_requests": inspector.max_requests,
                    "sessions": len(inspector.sessions), "trie_blocks": len(inspector.trie.by_hash)}
        else:
            own = [s for s in inspector.sessions.values() if viewer.sees(s.tenant)]
            kept = {"requests": sum(len(s.requests) for s in own), "max_requests": inspector.max_requests,
                    "sessions": len(own)}
    if not viewer.sees_all:  # a tenant sees the pool's sizes, nothing that other tenants' requests move
        sizes = _timeline(samples[-1:], TENANT_TIMELINE_COLUMNS)
        return {"timeline": {}, "pool": {name: sizes[name][0] for name in TENANT_TIMELINE_COLUMNS} if samples else {},
                "evictions": {}, "largest_prefixes": largest, "inspector": kept, "cache_wide": False}
    return {
        "timeline": _timeline(samples),
        "evictions": _evictions(last) if last is not None else {},
        "largest_prefixes": largest,
        "inspector": {**kept, "memory_bytes": inspector.memory_bytes()},
        "cache_wide": True,
    }


def _holder(inspector: Inspector, prefix: CachedPrefix) -> InspectedRequest | None:
    """The newest recorded request whose sequence produced the prefix's deepest block the inspector knows."""
    for block_hash in reversed(prefix.block_hashes):
        node = inspector.trie.by_hash.get(block_hash)
        if node is not None:
            return node.owner
    return None


def _timeline(samples: list[CacheSample], names: Sequence[str] = tuple(TIMELINE_COLUMNS)) -> dict[str, list]:
    """The samples as columns: "time", then ``names`` (of TIMELINE_COLUMNS)."""
    columns = {"time": [sample.time for sample in samples]}
    for i, name in enumerate(TIMELINE_COLUMNS):
        if name in names:
            columns[name] = [sample.values[i] for sample in samples]
    return columns


def _evictions(s: SchedulerStats) -> dict[str, int]:
    """Blocks that left a tier since the server started, by why."""
    return {
        "pressure": s.prefix_cache_evictions - s.prefix_cache_retained_evictions - s.prefix_cache_reset_evictions,
        "pressure_retained": s.prefix_cache_retained_evictions,
        "reset": s.prefix_cache_reset_evictions,
        "host_full": s.kv_host_dropped_blocks,
        "disk_full": s.kv_disk_dropped_blocks,
    }
