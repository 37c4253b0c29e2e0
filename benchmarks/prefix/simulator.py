"""Replays token requests against the engine's own ``KVCacheManager`` (no model) to measure prefix-cache hits.

Time advances in steps. Each step the scheduler takes up to ``max_num_seqs`` ready requests (a request is ready once
it has arrived and its parent has finished) in policy order, admits them all (so requests in the same step cannot hit each other's new
blocks, as in a real batch), commits their prompt and reply blocks, and frees them. After each step the cache is
trimmed to ``capacity_blocks`` by the manager's own eviction (LRU leaves); the pool has extra pages for the live batch
on top of that, so capacity means "blocks kept between requests", the quantity cache-size sweeps are about.
"""
from __future__ import annotations

import heapq
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Iterable, Sequence

from tqdm import tqdm

from engine.block_hashing import BlockHash, BlockHasher
from engine.config import EvictionPolicy, SchedulingPolicy
from engine.kv_cache import KVCacheManager
from engine.scheduler import admission_order

from benchmarks.prefix.trace import PromptTotals, TokenRequest


@dataclass(frozen=True)
class SimConfig:
    block_size: int = 16
    capacity_blocks: int | None = None  # None: unbounded (nothing is ever evicted)
    max_num_seqs: int = 8  # requests admitted together in one step
    policy: SchedulingPolicy = SchedulingPolicy.FCFS  # the engine's admission order (engine.scheduler)
    eviction_policy: EvictionPolicy = EvictionPolicy.LRU
    lookahead: int = 64  # how many ready requests "longest_prefix" compares (bounds the cost on big traces)
    commit_outputs: bool = True  # cache the reply's blocks too (the engine caches blocks during decode)
    ignore_salts: bool = False  # treat every request as unsalted (attribution: what salts cost)
    model_id: str = "sim"

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy", SchedulingPolicy(self.policy))  # accept the plain strings too
        object.__setattr__(self, "eviction_policy", EvictionPolicy(self.eviction_policy))
        if self.capacity_blocks is not None and self.capacity_blocks < 0:
            raise ValueError("capacity_blocks must be >= 0")
        if self.max_num_seqs < 1 or self.block_size < 1 or self.lookahead < 1:
            raise ValueError("max_num_seqs, block_size and lookahead must be positive")


@dataclass
class RequestResult:
    request_id: str
    session: str
    turn: int
    step: int
    prompt_tokens: int
    cached_tokens: int


@dataclass
class SimResult(PromptTotals):
    config: SimConfig
    results: list[RequestResult]
    evictions: int = 0
    peak_cached_blocks: int = 0
    by_id: dict[str, RequestResult] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.by_id = {r.request_id: r for r in self.results}

    def results_in(self, items: Sequence) -> list[RequestResult]:
        """This run's result for each item that has a ``request_id`` (e.g. requests in their original order)."""
        return [self.by_id[item.request_id] for item in items]


    def summary(self) -> dict:
        return {
            "config": asdict(self.config),
            "requests": len(self.results),
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "hit_rate": self.hit_rate,
            "evictions": self.evictions,
            "peak_cached_blocks": self.peak_cached_blocks,
        }


def _pages(num_ids: int, block_size: int) -> int:
    return -(-num_ids // block_size)


def _pool_size(requests: Sequence[TokenRequest], cfg: SimConfig) -> int:
    """Capacity plus room for the largest possible live batch, so admission never waits on eviction."""
    need = sorted((_pages(len(r.prompt) + len(r.output), cfg.block_size) for r in requests), reverse=True)
    batch = sum(need[: cfg.max_num_seqs])
    capacity = sum(need) if cfg.capacity_blocks is None else cfg.capacity_blocks
    return capacity + batch + 1


class ReadyQueue:
    """Requests become ready when they have arrived and their parent has finished; ready ones wait in arrival order."""

    def __init__(self, requests: Sequence[TokenRequest]) -> None:
        ids = {r.request_id for r in requests}
        if len(ids) != len(requests):
            raise ValueError("request ids must be unique")
        self.order = {r.request_id: i for i, r in enumerate(requests)}
        self.reqs = {r.request_id: r for r in requests}
        self.children: dict[str, list[TokenRequest]] = {}
        self.pending: list[tuple[int, int, str]] = []  # (arrival, order, id) of requests whose parent has finished
        self.heap: list[tuple[int, str]] = []  # (order, id) of ready requests
        for r in requests:
            if r.parent is not None and r.parent in ids:
                if self.order[r.parent] > self.order[r.request_id]:
                    raise ValueError(f"request {r.request_id} comes before its parent {r.parent}")
                self.children.setdefault(r.parent, []).append(r)
            else:
                self._release(r)

    def __bool__(self) -> bool:
        return bool(self.heap or self.pending)

    def _release(self, r: TokenRequest) -> None:
        heapq.heappush(self.pending, (r.arrival, self.order[r.request_id], r.request_id))

    def advance(self, step: int) -> int:
        """Move arrived requests to the ready heap; if none is ready, jump ahead to the next arrival."""
        if not self.heap and self.pending:
            step = max(step, self.pending[0][0])
        while self.pending and self.pending[0][0] <= step:
            _, order, rid = heapq.heappop(self.pending)
            heapq.heappush(self.heap, (order, rid))
        return step

    def take(self, cfg: SimConfig, num_cached_tokens: Callable[[TokenRequest], int] | None = None) -> list[TokenRequest]:
        """The next batch, in the engine's admission order (``num_cached_tokens`` is only asked by policies that
        rank by cached prefix)."""
        if cfg.policy is SchedulingPolicy.FCFS or num_cached_tokens is None:
            picked = [heapq.heappop(self.heap) for _ in range(min(cfg.max_num_seqs, len(self.heap)))]
        else:
            window = [heapq.heappop(self.heap) for _ in range(min(cfg.lookahead, len(self.heap)))]
            window = admission_order(cfg.policy, window, lambda e: num_cached_tokens(self.reqs[e[1]]))
            picked, rest = window[: cfg.max_num_seqs], window[cfg.max_num_seqs :]
            for entry in rest:
                heapq.heappush(self.heap, entry)
        return [self.reqs[rid] for _, rid in picked]

    def finished(self, request: TokenRequest) -> None:
        for child in self.children.pop(request.request_id, []):
            self._release(child)


def _salt(request: TokenRequest, cfg: SimConfig) -> str | None:
    return None if cfg.ignore_salts else request.salt


def simulate(requests: Sequence[TokenRequest], cfg: SimConfig, progress: bool = False) -> SimResult:
    kv = KVCacheManager(_pool_size(requests, cfg), cfg.block_size, enable_prefix_caching=True,
                        eviction_policy=cfg.eviction_policy)
    hasher = BlockHasher(cfg.block_size, cfg.model_id)
    hashes: dict[str, list[BlockHash]] = {}  # of each request's committed ids, computed once (as the engine does)

    def block_hashes(r: TokenRequest) -> list[BlockHash]:
        if r.request_id not in hashes:
            hashes[r.request_id] = hasher.hashes(r.committed_ids(cfg.commit_outputs), _salt(r, cfg))
        return hashes[r.request_id]

    def num_cached_tokens(r: TokenRequest) -> int:
        return kv.num_cached_tokens(block_hashes(r), len(r.prompt))

    queue = ReadyQueue(requests)
    results: list[RequestResult] = []
    peak = 0
    step = 0
    with tqdm(total=len(requests), disable=not progress, desc="simulate", unit="req", leave=False) as bar:
        while queue:
            step = queue.advance(step)
            batch = queue.take(cfg, num_cached_tokens)
            for r in batch:
                matched = kv.admit(r.request_id, block_hashes(r), r.prompt, len(r.prompt))
                if matched is None:  # cannot happen: the pool has room for any batch on top of the capacity
                    raise RuntimeError(f"simulator pool too small for request {r.request_id}")
                results.append(
                    RequestResult(r.request_id, r.session, r.turn, step, r.prompt_tokens, r.cached_tokens(matched))
                )
            for r in batch:
                ids = r.committed_ids(cfg.commit_outputs)
                if kv.allocate(r.request_id, max(len(ids), len(r.prompt))) is None:
                    raise RuntimeError(f"simulator pool too small for request {r.request_id}")
                kv.commit(r.request_id, block_hashes(r), ids, len(ids))
            peak = max(peak, kv.num_cached_blocks)
            for r in batch:
                kv.free(r.request_id)
                queue.finished(r)
            if cfg.capacity_blocks is not None and kv.num_cached_blocks > cfg.capacity_blocks:
                kv.evict(kv.num_cached_blocks - cfg.capacity_blocks)
            step += 1
            bar.update(len(batch))
    if len(results) != len(requests):
        raise ValueError("some requests never ran: a parent id is missing or the parent links form a cycle")
    return SimResult(cfg, results, evictions=kv.stats.evictions, peak_cached_blocks=peak)


def sweep(
    requests: Sequence[TokenRequest], base: SimConfig, field_name: str, values: Iterable, progress: bool = True
) -> list[SimResult]:
    """Run the simulator once per value of one config field (capacity_blocks, block_size, policy, eviction_policy,
    max_num_seqs)."""
    values = list(values)
    return [
        simulate(requests, replace(base, **{field_name: v}))
        for v in tqdm(values, desc=f"sweep {field_name}", disable=not progress, leave=False)
    ]
