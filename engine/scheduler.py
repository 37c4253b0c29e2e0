"""Continuous batching: each step, running decodes first, then prefill chunks, within a token budget."""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.kv_cache import KVCacheManager
from engine.model_runner import ScheduledBatch
from engine.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    batch: ScheduledBatch
    preempted: list[Request] = field(default_factory=list)
    # Requests that cannot continue even with the whole page pool to themselves (finished with "length").
    out_of_pages: list[Request] = field(default_factory=list)


class Scheduler:
    def __init__(self, cfg: EngineConfig, kv: KVCacheManager) -> None:
        self.cfg = cfg
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last one is preempted first
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, req: Request) -> None:
        """Release a request's pages (its full blocks stay cached) and forget it."""
        if req in self.running:
            self.running.remove(req)
            self.kv.free(req.request_id)
        elif req in self.waiting:
            self.waiting.remove(req)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(ScheduledBatch([], []))
        budget = self.cfg.max_num_batched_tokens
        # Decodes first (one token each, latency-critical), then continuing chunked prefills.
        for req in sorted(self.running, key=lambda r: r.is_prefilling):
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            n = min(req.num_uncomputed_tokens, budget)
            if not self._make_room(req, n, out):
                continue
            out.batch.requests.append(req)
            out.batch.num_new_tokens.append(n)
            budget -= n
        if not out.preempted:  # pages just ran short: admitting new work would only thrash
            budget = self._admit_waiting(budget, out.batch)
        return out

    def _make_room(self, req: Request, n: int, out: SchedulerOutput) -> bool:
        """Allocate pages for ``n`` more tokens of ``req``, preempting the newest other requests if needed."""
        while not self.kv.allocate(req.request_id, req.num_computed_tokens + n):
            victims = [r for r in self.running if r is not req and r not in out.batch.requests]
            if victims:
                self._preempt(victims[-1], out)
                continue
            if len(self.running) == 1:  # alone and still no room: the pool is too small for this sequence
                self.running.remove(req)
                self.kv.free(req.request_id)
                out.out_of_pages.append(req)
            else:
                self._preempt(req, out)
            return False
        return True

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        """Recompute later: release the pages now; its full blocks stay cached, so re-admission mostly hits."""
        self.running.remove(req)
        self.kv.free(req.request_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req)

    def _next_waiting(self) -> Request:
        if self.cfg.scheduling_policy == "longest_prefix" and self.waiting[0].status is not RequestStatus.PREEMPTED:
            return max(self.waiting, key=lambda r: self.kv.num_cached_tokens(r.token_ids, r.cache_salt))
        return self.waiting[0]

    def _admit_waiting(self, budget: int, batch: ScheduledBatch) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            req = self._next_waiting()
            cached = self.kv.admit(req.request_id, req.token_ids, budget, req.cache_salt)
            if cached is None:
                break
            self.waiting.remove(req)
            if req.status is RequestStatus.WAITING:  # first admission (not a preempted request coming back)
                req.num_cached_tokens = min(cached, req.num_prompt_tokens)
                req.timings.scheduled = time.perf_counter()
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = cached
            n = min(req.num_uncomputed_tokens, budget)
            self.running.append(req)
            batch.requests.append(req)
            batch.num_new_tokens.append(n)
            budget -= n
        return budget
