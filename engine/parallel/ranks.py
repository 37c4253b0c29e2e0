"""Rank 0's side of tensor parallelism: it starts ranks 1..N-1 as processes (torch.multiprocessing, spawn), sends
them each step's `SchedulerOutput`, and watches them.

A rank process that dies (an exception, which it reports before exiting, or a signal) is noticed two ways: rank 0's
collectives with it fail (gloo at once; NCCL is aborted), and a watcher thread sees its process end, which also
covers an idle engine. Either way the engine gets a `WorkerDiedError` carrying the rank's own error and stops for
good; nothing waits forever on a dead rank, at start-up included.
"""
from __future__ import annotations

import atexit
import logging
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from pathlib import Path

import torch
import torch.multiprocessing as mp

from engine.config import EngineConfig, ModelConfig
from engine.errors import WorkerDiedError
from engine.worker.model_runner import ModelRunner
from engine.outputs import SchedulerOutput
from engine.parallel.memory import RankMemory
from engine.parallel.sizes import check_sizes
from engine.parallel.state import StepChannel, abort_group, leave_group, rendezvous_store
from engine.parallel.rank import RankSpec, join, run_rank
from engine.core.processes import caller_script_hidden

log = logging.getLogger("kvserve.parallel")
STARTUP_POLL_S = 0.1
DEATH_GRACE_S = 2.0  # after a failed collective, how long the failing rank's process may take to be seen gone
STOP_TIMEOUT_S = 10.0
# A start-up that lost a rank ends at once when rank 0 waits in a collective (gloo fails it); one still waiting
# at the rendezvous for a rank that never came is left to its timeout, in a daemon thread.
ABANDON_START_S = 2.0


class TensorParallelRanks:
    """Ranks 1..N-1 seen from rank 0. Build with `launch`; `close` stops them."""

    def __init__(self, processes: list[mp.Process], errors: list[Connection]) -> None:
        self.processes = processes  # index i is rank i + 1
        self._errors = errors
        self.channel: StepChannel | None = None
        self.rank_memory: list[RankMemory] = []
        self.error: WorkerDiedError | None = None  # the first death seen
        self.on_death: Callable[[WorkerDiedError], None] | None = None  # the engine loop's, while one runs
        self._closing = threading.Event()
        self._wake_reader, self._wake_writer = mp.get_context("spawn").Pipe(duplex=False)
        self._watcher: threading.Thread | None = None
        self._starting: threading.Thread | None = None

    @classmethod
    def launch(cls, model_dir: Path, model_cfg: ModelConfig, cfg: EngineConfig,
               max_model_len: int) -> tuple[ModelRunner, TensorParallelRanks]:
        """Start ranks 1..N-1 and build rank 0's runner with them; returns once every rank has loaded its shard."""
        check_sizes(model_cfg, cfg, torch.cuda.device_count() if cfg.device.startswith("cuda") else 0)
        size = cfg.tensor_parallel_size
        store = rendezvous_store(size)
        spec = RankSpec(Path(model_dir), model_cfg, cfg, max_model_len, store.port)
        ctx = mp.get_context("spawn")
        processes, errors = [], []
        for rank in range(1, size):
            reader, writer = ctx.Pipe(duplex=False)
            process = ctx.Process(target=run_rank, args=(rank, spec, writer), name=f"kvserve-tp-rank{rank}",
                                  daemon=True)
            with caller_script_hidden():
                process.start()
            writer.close()
            processes.append(process)
            errors.append(reader)
        ranks = cls(processes, errors)
        try:
            runner, ranks.channel, ranks.rank_memory = ranks._unless_one_dies(lambda: join(0, spec, store))
        except BaseException:
            ranks._kill()
            if not ranks._starting.is_alive():  # else it still waits to join; whatever it joins is left to it
                leave_group()
            raise
        ranks._watcher = threading.Thread(target=ranks._watch, name="kvserve-tp-watch", daemon=True)
        ranks._watcher.start()
        # A script that never closes its engine must still end: the ranks ignore SIGTERM (rank 0 drains first),
        # so multiprocessing's own exit handler would terminate them in vain, then join them forever.
        atexit.register(ranks.close)
        return runner, ranks

    # ---- the engine thread -----------------------------------------------------------------------------------------
    def send(self, sched: SchedulerOutput) -> None:
        self.channel.send(sched)

    def raise_if_dead(self, cause: BaseException) -> None:
        """After ``cause`` broke a step: raise `WorkerDiedError` if a rank died (its collectives failing was the
        first sign), else return (the caller re-raises ``cause``)."""
        dead = self._first_dead(DEATH_GRACE_S)
        if dead is not None:
            raise self._died(dead) from cause

    # ---- any thread ----------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop every rank (after the step in flight) and leave the process group."""
        if self._closing.is_set():
            return
        self._closing.set()
        atexit.unregister(self.close)
        self._wake_writer.send(None)
        if self.error is None and self.channel is not None:  # else the survivors may wait on the dead: kill them
            try:
                self.channel.send(None)
                deadline = time.monotonic() + STOP_TIMEOUT_S
                for process in self.processes:
                    process.join(max(0.0, deadline - time.monotonic()))
            except RuntimeError:  # a rank died meanwhile
                log.warning("could not reach every tensor-parallel worker to stop it")
        self._kill()
        leave_group()

    # ---- internals ------------------------------------------------------------------------------------------------
    def _unless_one_dies(self, start: Callable):
        """``start()`` (rank 0's part of start-up, which waits on the other ranks' collectives) run aside, so that a
        rank dying meanwhile raises here instead of leaving rank 0 waiting."""
        result: list = []
        failure: list[BaseException] = []

        def run() -> None:
            try:
                result.append(start())
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                failure.append(exc)

        thread = self._starting = threading.Thread(target=run, name="kvserve-tp-start", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(STARTUP_POLL_S)
            dead = self._first_dead(0)
            if dead is not None:
                error = self._died(dead)
                self._kill()  # rank 0's collectives with them fail now, which ends the start-up thread
                thread.join(ABANDON_START_S)
                raise error
        if failure:
            dead = self._first_dead(DEATH_GRACE_S)
            if dead is not None:
                raise self._died(dead) from failure[0]
            raise failure[0]
        return result[0]

    def _first_dead(self, timeout: float) -> int | None:
        """Index of a rank whose process ended, waiting up to ``timeout`` seconds for one."""
        ended = wait([p.sentinel for p in self.processes], timeout)
        for i, process in enumerate(self.processes):
            if process.sentinel in ended:
                return i
        return None

    def _died(self, index: int) -> WorkerDiedError:
        if self.error is not None:
            return self.error
        process, errors = self.processes[index], self._errors[index]
        deadline = time.monotonic() + 1.0  # its pipes close as it exits, a moment before it can be reaped
        while process.exitcode is None and time.monotonic() < deadline:
            time.sleep(0.01)
        code = process.exitcode
        how = f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0 else \
            f"exited with status {code}"
        try:
            reported = errors.recv() if errors.poll() else ""
        except EOFError:  # it died without a word (a signal, or before it could report)
            reported = ""
        message = f"tensor-parallel worker rank {index + 1} (pid {process.pid}) {how}"
        self.error = WorkerDiedError(message + (f":\n{reported.rstrip()}" if reported else ""))
        return self.error

    def _watch(self) -> None:
        ended = wait([p.sentinel for p in self.processes] + [self._wake_reader])
        if self._closing.is_set() or self._wake_reader in ended:
            return
        error = self._died(self._first_dead(0))
        log.error("%s", error)
        abort_group()  # an NCCL collective waiting on the dead rank fails now
        callback = self.on_death
        if callback is not None:
            callback(error)

    def _kill(self) -> None:
        for process in self.processes:
            if process.is_alive():
                process.kill()
            process.join(STOP_TIMEOUT_S)
