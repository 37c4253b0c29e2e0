"""A prepare lane's thread, fair across tenants: jobs (rendering, tokenizing) queue per tenant and the thread takes
them round-robin, one tenant's next job after every other waiting tenant's. Twenty too-long prompts of one tenant
then delay another tenant's small request by at most the one job in progress, not by all twenty (4.9 s before, on
two cores: the lane was first come, first served). Within a tenant, jobs run in arrival order.
"""
from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

_Job = tuple[Future, Callable[[], Any]]


class FairLane:
    """One worker thread (``initializer`` runs on it first) taking each tenant's jobs in turn."""

    def __init__(self, name: str, initializer: Callable[[], None] = lambda: None) -> None:
        self._queues: OrderedDict[Any, deque[_Job]] = OrderedDict()  # tenants with jobs waiting, next first
        self._cv = threading.Condition()
        self._closed = False
        self._initializer = initializer
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def submit(self, tenant: Any, fn: Callable[[], Any]) -> Future:
        """Queue ``fn`` for ``tenant``; its future is cancellable until the job starts (then it never runs)."""
        future: Future = Future()
        with self._cv:
            if self._closed:
                raise RuntimeError("the prepare lane is shut down")
            queue = self._queues.get(tenant)
            if queue is None:
                queue = self._queues[tenant] = deque()
            queue.append((future, fn))
            self._cv.notify()
        return future

    def waiting(self) -> int:
        with self._cv:
            return sum(len(queue) for queue in self._queues.values())

    def shutdown(self) -> None:
        """Stop taking jobs: those still waiting are cancelled; the one running finishes."""
        with self._cv:
            self._closed = True
            jobs = [job for queue in self._queues.values() for job in queue]
            self._queues.clear()
            self._cv.notify_all()
        for future, _ in jobs:
            future.cancel()

    def _next(self) -> _Job | None:
        with self._cv:
            while not self._queues and not self._closed:
                self._cv.wait()
            if not self._queues:
                return None
            tenant, queue = self._queues.popitem(last=False)
            job = queue.popleft()
            if queue:
                self._queues[tenant] = queue  # back of the line
            return job

    def _work(self) -> None:
        self._initializer()
        while (job := self._next()) is not None:
            future, fn = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
                future.set_exception(exc)
            else:
                future.set_result(result)
