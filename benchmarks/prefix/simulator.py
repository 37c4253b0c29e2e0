"""Replays token requests against the engine's own ``KVCacheManager`` (no model) to measure prefix-cache hits.

Each step the scheduler takes up to ``max_num_seqs`` ready requests (a request is ready once it has arrived and its
parent has finished, plus the parent's tool-call gap, ``think_s``) in policy order, admits them, commits their
prompt and reply blocks, and frees them. Two ways to bound the cache:

- ``capacity_blocks`` (cache-size sweeps): every request of a step is admitted before any commits (requests in the
  same step never hit each other's new blocks), and after each step the cache is trimmed to the capacity by the
  manager's own eviction; the pool has room for the live batch on top, so capacity means "blocks kept between
  requests".
- ``num_kv_blocks`` (the engine's pool, memory pressure): admission evicts on demand as the engine does, a request
  commits its prompt blocks as soon as it is admitted (a later request of the step can hit them, as in the engine),
  and a request that does not fit, with its reply, waits for the next step (the simulator does not preempt). With ``engine_max_tokens`` the blocks of the tokens the
  engine generates (never hit by later turns, which carry scripted replies) take their room too. Then the simulator
  predicts the engine's cached tokens request for request (tests/bench/prefix/test_engine_run.py).

The manager brings its retention and tiers: pins (``TokenRequest.pins``), session holds (``tool_call_ttl_s`` for
requests that end in tool calls), host and disk tiers (``host_blocks``, ``disk_blocks``), all on the simulator's
clock. Without a ``costs`` model every step takes one time unit and arrivals count steps; with one, time is seconds:
a step lasts its prefill (computed tokens, restored bytes) plus its decode, which is also each request's modeled TTFT
(first token at the end of the prefill, plus the time it waited while ready).
"""
from __future__ import annotations

import heapq
import itertools
import statistics
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Iterable, Sequence

from tqdm import tqdm

from engine.kv.block_hashing import BlockHash, BlockHasher
from engine.config import EvictionPolicy, SchedulingPolicy
from engine.kv.manager import KVCacheManager
from engine.retention import Retention
from engine.sched.scheduler import admission_order

from benchmarks.prefix.traces.trace import PromptTotals, TokenRequest


@dataclass(frozen=True)
class CostModel:
    """Seconds a step takes: its prefill (a fixed cost, computed prompt tokens, blocks copied back from the host and
    disk tiers) and its decode steps."""

    prefill_tokens_per_s: float
    decode_step_s: float
    bytes_per_block: int
    host_bytes_per_s: float = 25e9  # host <-> device (PCIe 5 x16 is about 50 GB/s each way; half of it)
    disk_bytes_per_s: float = 3e9  # an NVMe drive
    prefill_overhead_s: float = 0.0  # per prefill step, whatever its size

    def prefill_s(self, computed_tokens: int, host_blocks: int, disk_blocks: int) -> float:
        return (self.prefill_overhead_s + computed_tokens / self.prefill_tokens_per_s
                + host_blocks * self.bytes_per_block / self.host_bytes_per_s
                + disk_blocks * self.bytes_per_block / self.disk_bytes_per_s)


@dataclass(frozen=True)
class SimConfig:
    block_size: int = 16
    capacity_blocks: int | None = None  # None: unbounded (nothing is ever evicted)
    max_num_seqs: int = 8  # requests admitted together in one step
    policy: SchedulingPolicy = SchedulingPolicy.FCFS  # the engine's admission order (engine.sched.scheduler)
    eviction_policy: EvictionPolicy = EvictionPolicy.LRU
    lookahead: int = 64  # how many ready requests "longest_prefix" compares (bounds the cost on big traces)
    commit_outputs: bool = True  # cache the reply's blocks too (the engine caches blocks during decode)
    ignore_salts: bool = False  # treat every request as unsalted (attribution: what salts cost)
    model_id: str = "sim"
    num_kv_blocks: int | None = None  # the engine's pool: evict on demand (capacity_blocks is then not used)
    engine_max_tokens: int = 0  # tokens the engine generates per request (their blocks take room, never hit)
    host_blocks: int = 0  # the host tier (engine: --kv-offload-gb)
    disk_blocks: int = 0  # the disk tier (engine: --kv-disk-dir, --kv-disk-gb)
    tool_call_ttl_s: float = 0.0  # hold a session's blocks after a reply that ends in tool calls (0: no holds)
    max_retained_fraction: float = 0.5
    costs: CostModel | None = None  # None: one time unit per step

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
    step: int  # the index of its step (batch)
    prompt_tokens: int
    cached_tokens: int
    start: float = 0.0  # when its step began (simulated time)
    restored_blocks: tuple[int, int] = (0, 0)  # of the cached blocks, restored from (host, disk)
    wait_s: float = 0.0  # ready but not yet scheduled
    prefill_s: float | None = None  # with a cost model: its step's prefill (the first token comes at its end)
    step_s: float = 1.0  # how long its step took

    @property
    def ttft_s(self) -> float | None:
        return None if self.prefill_s is None else self.wait_s + self.prefill_s


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


    @property
    def ttft_p50_s(self) -> float | None:
        ttfts = [r.ttft_s for r in self.results if r.ttft_s is not None]
        return statistics.median(ttfts) if ttfts else None

    def summary(self) -> dict:
        return {
            "config": asdict(self.config),
            "requests": len(self.results),
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "hit_rate": self.hit_rate,
            "host_restored_blocks": sum(r.restored_blocks[0] for r in self.results),
            "disk_restored_blocks": sum(r.restored_blocks[1] for r in self.results),
            "ttft_p50_s": self.ttft_p50_s,
            "evictions": self.evictions,
            "peak_cached_blocks": self.peak_cached_blocks,
        }


def _pages(num_ids: int, block_size: int) -> int:
    return -(-num_ids // block_size)


def _pool_size(requests: Sequence[TokenRequest], cfg: SimConfig) -> int:
    """Capacity plus room for the largest possible live batch, so admission never waits on eviction."""
    need = sorted((_pages(len(r.prompt) + max(len(r.output), cfg.engine_max_tokens), cfg.block_size)
                   for r in requests), reverse=True)
    batch = sum(need[: cfg.max_num_seqs])
    capacity = sum(need) if cfg.capacity_blocks is None else cfg.capacity_blocks
    return capacity + batch + 1


class ReadyQueue:
    """Requests become ready when they have arrived and their parent has finished (plus their ``think_s``); ready
    ones wait in arrival order. Times are steps or seconds, whatever the caller counts in."""

    def __init__(self, requests: Sequence[TokenRequest]) -> None:
        ids = {r.request_id for r in requests}
        if len(ids) != len(requests):
            raise ValueError("request ids must be unique")
        self.order = {r.request_id: i for i, r in enumerate(requests)}
        self.reqs = {r.request_id: r for r in requests}
        self.children: dict[str, list[TokenRequest]] = {}
        self.pending: list[tuple[float, int, str]] = []  # (ready time, order, id) of requests whose parent finished
        self.heap: list[tuple[int, str]] = []  # (order, id) of ready requests
        self.ready_at: dict[str, float] = {}
        for r in requests:
            if r.parent is not None and r.parent in ids:
                if self.order[r.parent] > self.order[r.request_id]:
                    raise ValueError(f"request {r.request_id} comes before its parent {r.parent}")
                self.children.setdefault(r.parent, []).append(r)
            else:
                self._release(r, r.arrival)

    def __bool__(self) -> bool:
        return bool(self.heap or self.pending)

    def _release(self, r: TokenRequest, at: float) -> None:
        heapq.heappush(self.pending, (at, self.order[r.request_id], r.request_id))

    def advance(self, now: float) -> float:
        """Move arrived requests to the ready heap; if none is ready, jump ahead to the next arrival."""
        if not self.heap and self.pending:
            now = max(now, self.pending[0][0])
        while self.pending and self.pending[0][0] <= now:
            at, order, rid = heapq.heappop(self.pending)
            self.ready_at[rid] = at
            heapq.heappush(self.heap, (order, rid))
        return now

    def take(self, cfg: SimConfig,
             num_cached_tokens: Callable[[TokenRequest], int] | None = None) -> list[TokenRequest]:
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

    def put_back(self, requests: Sequence[TokenRequest]) -> None:
        """Requests taken but not admitted (no room): ready again, in their order."""
        for r in requests:
            heapq.heappush(self.heap, (self.order[r.request_id], r.request_id))

    def finished(self, request: TokenRequest, at: float) -> None:
        """``request`` ended at time ``at``: its children arrive after their tool-call gap."""
        for child in self.children.pop(request.request_id, []):
            self._release(child, max(child.arrival, at + child.think_s))


def _salt(request: TokenRequest, cfg: SimConfig) -> str | None:
    return None if cfg.ignore_salts else request.salt


class _Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


class _Simulation:
    """One run's state: the manager, the hashes of each request (computed once, as the engine does), the queue."""

    def __init__(self, requests: Sequence[TokenRequest], cfg: SimConfig) -> None:
        self.cfg = cfg
        self.clock = _Clock()
        self.kv = KVCacheManager(cfg.num_kv_blocks or _pool_size(requests, cfg), cfg.block_size, True,
                                 cfg.eviction_policy, max_retained_fraction=cfg.max_retained_fraction,
                                 host_blocks=cfg.host_blocks, disk_blocks=cfg.disk_blocks, clock=self.clock)
        self.hasher = BlockHasher(cfg.block_size, cfg.model_id)
        self.hashes: dict[str, list[BlockHash]] = {}
        self.ids: dict[str, list[int]] = {}
        self.queue = ReadyQueue(requests)
        self.placeholders = itertools.count(-1, -1)  # token ids no prompt has: the engine's own generated tokens

    def block_hashes(self, r: TokenRequest) -> list[BlockHash]:
        if r.request_id not in self.hashes:
            self.hashes[r.request_id] = self.hasher.hashes(self.committed_ids(r), _salt(r, self.cfg), r.images)
        return self.hashes[r.request_id]

    def committed_ids(self, r: TokenRequest) -> list[int]:
        """The ids whose K/V exist once the request ran: its prompt, its reply (``commit_outputs``) and the tokens
        the engine generates (all but the last, which is never computed)."""
        if r.request_id not in self.ids:
            generated = max(self.cfg.engine_max_tokens - 1, 0)
            self.ids[r.request_id] = r.committed_ids(self.cfg.commit_outputs) + [
                next(self.placeholders) for _ in range(generated)]
        return self.ids[r.request_id]

    def num_cached_tokens(self, r: TokenRequest) -> int:
        return self.kv.num_cached_tokens(self.block_hashes(r), len(r.prompt))

    def admit(self, batch: list[TokenRequest]) -> list[tuple[TokenRequest, int, tuple[int, int]]]:
        """(request, matched ids, blocks restored from host and disk) for each request admitted, in order; with the
        engine's pool, the first that does not fit and those after it wait for the next step."""
        kv, pool = self.kv, self.cfg.num_kv_blocks is not None
        admitted = []
        replies = 0  # blocks the replies of the requests admitted so far will take
        for i, r in enumerate(batch):
            host, disk = kv.stats.host_hits, kv.stats.disk_hits
            # With the engine's pool, the step's replies must fit too: the simulator does not preempt.
            reply = kv.blocks_needed(len(self.committed_ids(r))) - kv.blocks_needed(len(r.prompt)) if pool else 0
            matched = kv.admit(r.request_id, self.block_hashes(r), r.prompt, len(r.prompt), retention=_retention(r),
                               reserve_tokens=(replies + reply) * kv.block_size)
            if matched is None:
                if not pool:  # cannot happen: the pool has room for any batch on top of the capacity
                    raise RuntimeError(f"simulator pool too small for request {r.request_id}")
                self.queue.put_back(batch[i:])
                break
            if pool:  # the engine commits the blocks a step fills as soon as it is scheduled
                kv.commit(r.request_id, self.block_hashes(r), r.prompt, len(r.prompt))
                replies += reply
            restored = ((kv.stats.host_hits - host) // kv.block_size, (kv.stats.disk_hits - disk) // kv.block_size)
            admitted.append((r, matched, restored))
        return admitted

    def finish(self, batch: list[TokenRequest], step_s: float) -> None:
        """Reply blocks, then release; a reply that ends in tool calls holds its session's blocks."""
        kv = self.kv
        for r in batch:
            ids = self.committed_ids(r)
            if kv.allocate(r.request_id, max(len(ids), len(r.prompt))) is None:
                raise RuntimeError(f"the pool cannot hold the reply of request {r.request_id}")
            kv.commit(r.request_id, self.block_hashes(r), ids, len(ids))
        for r in batch:  # the hold is counted from the end of the step (the clock stays at its start)
            kv.free(r.request_id, self.cfg.tool_call_ttl_s + step_s if r.ends_in_tool_call and self.cfg.tool_call_ttl_s
                    else 0.0)
            self.queue.finished(r, self.clock.now + step_s)


def _retention(r: TokenRequest) -> Retention | None:
    return Retention(r.pins) if r.pins else None


def simulate(requests: Sequence[TokenRequest], cfg: SimConfig, progress: bool = False) -> SimResult:
    sim = _Simulation(requests, cfg)
    kv, queue, costs = sim.kv, sim.queue, cfg.costs
    results: list[RequestResult] = []
    peak = 0
    now, step = 0.0, 0
    with tqdm(total=len(requests), disable=not progress, desc="simulate", unit="req", leave=False) as bar:
        while queue:
            now = sim.clock.now = queue.advance(now)
            admitted = sim.admit(queue.take(cfg, sim.num_cached_tokens))
            computed = sum(len(r.prompt) - r.cached_tokens(m) for r, m, _ in admitted)
            prefill_s = step_s = 1.0
            if costs is not None:
                prefill_s = costs.prefill_s(computed, sum(h for *_, (h, _) in admitted),
                                            sum(d for *_, (_, d) in admitted))
                step_s = prefill_s + costs.decode_step_s * max(cfg.engine_max_tokens - 1, 0)
            for r, matched, restored in admitted:
                wait_s = now - queue.ready_at[r.request_id]
                results.append(RequestResult(r.request_id, r.session, r.turn, step, r.prompt_tokens,
                                             r.cached_tokens(matched), now, restored, wait_s,
                                             None if costs is None else prefill_s, step_s))
            sim.finish([r for r, _, _ in admitted], step_s)
            peak = max(peak, kv.num_cached_blocks)
            trim = cfg.num_kv_blocks is None and cfg.capacity_blocks is not None
            if trim and kv.num_cached_blocks > cfg.capacity_blocks:
                kv.evict(kv.num_cached_blocks - cfg.capacity_blocks)
            now += step_s
            step += 1
            bar.update(len(admitted))
    if len(results) != len(requests):
        raise ValueError("some requests never ran: a parent id is missing or the parent links form a cycle")
    return SimResult(cfg, results, evictions=kv.stats.evictions, peak_cached_blocks=peak)


def sweep(
    requests: Sequence[TokenRequest], base: SimConfig, field_name: str, values: Iterable, progress: bool = True
) -> list[SimResult]:
    """Run the simulator once per value of one config field (capacity_blocks, block_size, policy, eviction_policy,
    max_num_seqs, host_blocks, tool_call_ttl_s, ...)."""
    values = list(values)
    return [
        simulate(requests, replace(base, **{field_name: v}))
        for v in tqdm(values, desc=f"sweep {field_name}", disable=not progress, leave=False)
    ]
