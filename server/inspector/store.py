"""What the inspector keeps: the last N finished requests (a ring), grouped into agent sessions, their tokens in a
prefix trie (stored once per shared prefix), and the cache's gauges over time.

`Inspector.observe` is the one way in (server/pipeline/generation.py calls it where a request finishes); the views read under
the same lock. Memory is bounded: the ring drops its oldest request (and the trie the blocks only it needed) past
``max_requests``, a session lives while it has a request in the ring, and the timeline is a ring of samples.
"""
from __future__ import annotations

import asyncio
import secrets
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.kv.block_hashing import BlockHasher
from engine.outputs import SchedulerStats
from server.inspector.attribution import Conversation, Divergence, ImageSpans, Previous, attribute, first_image_change
from server.inspector.prompt_trie import PromptTrie, TrieNode, pack

DEFAULT_MAX_REQUESTS = 1000
TIMELINE_SAMPLES = 3600  # an hour at one sample a second (fewer while nothing changes)
# An anonymous request (no session id) continues the request that last produced its deepest cached block, if it
# shares at least this share of that request's prompt; else it starts a session of its own.
ANONYMOUS_PARENT_SHARE = 0.5


@dataclass(frozen=True)
class Observation:
    """A finished request, as the server hands it over."""

    request_id: str
    endpoint: str
    salt: str | None  # the engine's cache salt: the tenant's (server/cache/cache_salt.py), maybe scoped by the request
    session: str | None  # the client's session id (server/cache/session.py), if it sent one
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    cached_tokens: int  # device + host + disk
    host_cached_tokens: int
    disk_cached_tokens: int
    queue_s: float | None
    ttft_s: float | None
    e2e_s: float | None
    finish_reason: str
    breakpoints: tuple[tuple[int, float], ...] = ()  # (prompt tokens, TTL seconds) of its cache_control pins
    conversation: Conversation = Conversation()
    time: float = field(default_factory=time.time)
    images: ImageSpans = ()  # its prompt's images (their blocks hash their content: equal tokens can miss)


@dataclass(eq=False, slots=True)
class InspectedRequest:
    seq: int
    request_id: str
    session: Session
    endpoint: str
    time: float
    salt: str | None
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    host_cached_tokens: int
    disk_cached_tokens: int
    queue_s: float | None
    ttft_s: float | None
    e2e_s: float | None
    finish_reason: str
    breakpoints: tuple[tuple[int, float], ...]
    parent_id: str | None
    ideal_tokens: int
    divergence: Divergence | None
    misses: dict[str, int]
    end: TrieNode | None = None  # the trie node of its sequence's last full block
    tail: bytes = b""  # the tokens after it
    tenant_seq: int = 0  # its number among its tenant's requests (a tenant's cursor: `seq` counts everyone's)
    epoch: int = 0  # its conversation's compaction epoch (server/api/compaction.py)
    images: ImageSpans = ()  # its prompt's images, as the next request's image changes are found

    @property
    def device_cached_tokens(self) -> int:
        return self.cached_tokens - self.host_cached_tokens - self.disk_cached_tokens


@dataclass(eq=False)
class Session:
    key: str  # the inspector's id for it ("s3f9a0c1d"), random: a count would tell how many sessions others have
    client_id: str | None  # what the client called it (None: grouped by shared prefix)
    tenant: str | None
    requests: deque[InspectedRequest] = field(default_factory=deque)  # in the ring, oldest first
    last_conversation: Conversation = Conversation()  # the last request's digest: explains the next one's change


# What the timeline keeps of each engine snapshot (blocks per tier, the hit counters), in this order.
TIMELINE_COLUMNS: dict[str, Callable[[SchedulerStats], int]] = {
    "device_used": lambda s: s.kv_blocks_total - s.kv_blocks_free,  # held by running sequences
    "device_cached": lambda s: s.kv_blocks_cached,
    "device_free": lambda s: s.kv_blocks_free,  # never used, or cached and held by nobody
    "device_pinned": lambda s: s.kv_blocks_retained,
    "device_total": lambda s: s.kv_blocks_total,
    "host_cached": lambda s: s.kv_host_blocks_cached,
    "host_total": lambda s: s.kv_host_blocks_total,
    "disk_cached": lambda s: s.kv_disk_blocks_cached,
    "disk_total": lambda s: s.kv_disk_blocks_total,
    "hits_tokens": lambda s: s.prefix_cache_hits_tokens,
    "queries_tokens": lambda s: s.prefix_cache_queries_tokens,
}


@dataclass(frozen=True, slots=True)
class CacheSample:
    time: float
    values: tuple[int, ...]  # TIMELINE_COLUMNS' values


class Inspector:
    def __init__(self, hasher: BlockHasher, model_name: str, max_requests: int,
                 decode: Callable[[list[int]], str]) -> None:
        """``decode``: token ids -> text, on the thread that calls `observe` (it explains template changes)."""
        if max_requests < 1:
            raise ValueError(f"the inspector keeps at least one request, not {max_requests}")
        self.model_name = model_name
        self.block_size = hasher.block_size
        self.max_requests = max_requests
        self.trie = PromptTrie(hasher)
        self.ring: deque[InspectedRequest] = deque()
        self.by_id: dict[str, InspectedRequest] = {}
        self.sessions: dict[str, Session] = {}
        self._named: dict[tuple[str | None, str], Session] = {}  # (tenant, client id) -> session
        # Each tenant's salts (its own, and those its requests' cache_salt scoped inside it) with how many requests in
        # the ring used each: a miss is charged to "different_salt" only against the same tenant's other salts, so no
        # view depends on another tenant's prompts (it would answer "is this prefix cached for someone?").
        self._tenant_salts: dict[str | None, dict[str | None, int]] = {}
        self._tenant_seqs: dict[str | None, int] = {}  # each tenant's requests so far (one int per tenant ever seen)
        self.timeline: deque[CacheSample] = deque(maxlen=TIMELINE_SAMPLES)
        self.latest_stats: SchedulerStats | None = None  # the last snapshot sampled (its counters: evictions)
        self.lock = threading.RLock()
        self._decode = decode
        self._seq = 0

    # ---- in -------------------------------------------------------------------------------------------------------
    def observe(self, obs: Observation, tenant: str | None) -> InspectedRequest:
        with self.lock:
            bs = self.block_size
            prompt = pack(obs.prompt_token_ids)
            sequence = prompt + pack(obs.output_token_ids)
            known = self.trie.known_path(obs.salt, sequence)  # one walk: the ideal, the parent, the insert
            num_prompt = len(obs.prompt_token_ids)
            shareable = max(0, (num_prompt - 1) // bs)  # the engine always recomputes the last prompt token
            ideal_blocks = min(len(known), shareable)
            own_salts = self._tenant_salts.setdefault(tenant, {})
            unsalted_blocks = ideal_blocks if ideal_blocks == shareable else max(
                ideal_blocks, self.trie.best_match_other_salts(obs.salt, prompt, shareable, own_salts))
            own_salts[obs.salt] = own_salts.get(obs.salt, 0) + 1
            ideal, unsalted = ideal_blocks * bs, unsalted_blocks * bs
            session, parent = self._session_of(obs, tenant, known[: num_prompt // bs])
            previous, image_change = None, None
            if parent is not None:
                previous = Previous(self.trie.sequence(parent.end, parent.tail), parent.prompt_tokens,
                                    session.last_conversation)
                image_change = first_image_change(obs.images, parent.images)
                if image_change is not None:  # the trie sees tokens only: no cache serves blocks past the change
                    ideal, unsalted = min(ideal, image_change // bs * bs), min(unsalted, image_change // bs * bs)
            divergence, misses = attribute(prompt, obs.cached_tokens, ideal, unsalted, previous, obs.conversation,
                                           self._decode, image_change)
            self._seq += 1
            record = InspectedRequest(
                self._seq, obs.request_id, session, obs.endpoint, obs.time, obs.salt, num_prompt,
                len(obs.output_token_ids), obs.cached_tokens, obs.host_cached_tokens, obs.disk_cached_tokens,
                obs.queue_s, obs.ttft_s, obs.e2e_s, obs.finish_reason, obs.breakpoints,
                parent.request_id if parent else None, ideal, divergence, dict(misses.most_common()),
            )
            self._tenant_seqs[tenant] = record.tenant_seq = self._tenant_seqs.get(tenant, 0) + 1
            record.epoch = obs.conversation.epoch
            record.images = obs.images
            record.end = self.trie.insert(obs.salt, sequence, known, record)
            record.tail = self.trie.tail(sequence)
            self.ring.append(record)
            self.by_id[record.request_id] = record
            session.requests.append(record)
            session.last_conversation = obs.conversation.digest()
            while len(self.ring) > self.max_requests:
                self._drop_oldest()
        return record

    def _session_of(self, obs: Observation, tenant: str | None,
                    known: list[TrieNode]) -> tuple[Session, InspectedRequest | None]:
        """The session a request belongs to and the request it follows (None: the session's first). ``known``: the
        trie's nodes of the prompt's leading blocks."""
        if obs.session is not None:
            session = self._named.get((tenant, obs.session))
            if session is None:
                session = self._named[(tenant, obs.session)] = self._new_session(obs.session, tenant)
            return session, session.requests[-1] if session.requests else None
        owner: InspectedRequest | None = known[-1].owner if known else None
        if (owner is not None and owner.session.client_id is None
                and len(known) * self.block_size >= ANONYMOUS_PARENT_SHARE * owner.prompt_tokens):
            return owner.session, owner
        return self._new_session(None, tenant), None

    def _new_session(self, client_id: str | None, tenant: str | None) -> Session:
        session = Session(f"s{secrets.token_hex(4)}", client_id, tenant)
        while session.key in self.sessions:
            session.key = f"s{secrets.token_hex(4)}"
        self.sessions[session.key] = session
        return session

    def _drop_oldest(self) -> None:
        record = self.ring.popleft()
        del self.by_id[record.request_id]
        self.trie.release(record.end, record.salt)
        session = record.session
        own_salts = self._tenant_salts[session.tenant]
        own_salts[record.salt] -= 1
        if not own_salts[record.salt]:
            del own_salts[record.salt]
            if not own_salts:
                del self._tenant_salts[session.tenant]
        session.requests.popleft()
        if not session.requests:
            del self.sessions[session.key]
            if session.client_id is not None:
                del self._named[(session.tenant, session.client_id)]

    # ---- the cache over time -----------------------------------------------------------------------------------
    def sample(self, stats: SchedulerStats, now: float | None = None, quiet_s: float = 30.0) -> None:
        """Add the engine's gauges to the timeline, unless nothing changed since the last sample (and it is younger
        than ``quiet_s``)."""
        if not stats.kv_blocks_total:  # the engine has not stepped yet
            return
        now = time.time() if now is None else now
        values = tuple(column(stats) for column in TIMELINE_COLUMNS.values())
        with self.lock:
            self.latest_stats = stats
            last = self.timeline[-1] if self.timeline else None
            if last is None or last.values != values or now - last.time >= quiet_s:
                self.timeline.append(CacheSample(now, values))

    async def sample_forever(self, stats: Callable[[], SchedulerStats], interval_s: float = 1.0) -> None:
        while True:
            self.sample(stats())
            await asyncio.sleep(interval_s)

    def updated_sessions(self, after: int) -> tuple[int, list[Session]]:
        """The newest request's number, and the sessions with requests newer than ``after`` (newest first)."""
        with self.lock:
            sessions: dict[str, Session] = {}
            for record in reversed(self.ring):
                if record.seq <= after:
                    break
                sessions.setdefault(record.session.key, record.session)
            return self._seq, list(sessions.values())

    def updated_sessions_of(self, tenant: str | None, after: int) -> tuple[int, list[Session]]:
        """`updated_sessions` for one tenant, numbered among its own requests (`tenant_seq`), so that nothing in it
        depends on other tenants' requests."""
        with self.lock:
            sessions: dict[str, Session] = {}
            for record in reversed(self.ring):
                if record.session.tenant == tenant and record.tenant_seq > after:
                    sessions.setdefault(record.session.key, record.session)
            return self._tenant_seqs.get(tenant, 0), list(sessions.values())

    # ---- size ---------------------------------------------------------------------------------------------------
    def memory_bytes(self) -> int:
        """An estimate of what the inspector holds: the trie, the records, the sessions' last digests."""
        with self.lock:
            total = self.trie.memory_bytes()
            for record in self.ring:
                total += sys.getsizeof(record) + sys.getsizeof(record.tail) + sys.getsizeof(record.misses)
            for session in self.sessions.values():
                total += sys.getsizeof(session) + _deep_size(session.last_conversation.messages)
                total += _deep_size(session.last_conversation.tools)
            return total


def _deep_size(value: Any) -> int:
    size = sys.getsizeof(value)
    if isinstance(value, dict):
        size += sum(_deep_size(k) + _deep_size(v) for k, v in value.items())
    elif isinstance(value, list | tuple):
        size += sum(_deep_size(v) for v in value)
    return size
