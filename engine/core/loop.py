"""The engine thread: one background thread owns the (not thread-safe) `LLMEngine`; other threads talk to it only
through a command queue one way and output sinks (one per submitter: a generate call, a server) the other way.

The loop blocks on the command queue while the engine is idle (no spinning), and drains every queued command
before each step, so requests that arrive together are admitted together and batched by the scheduler. It hands
out token-level outputs only, one `StepOutputs` per sink per step: text is made by an `OutputProcessor` on the
receiving side. Requests should arrive prepared (`LLMEngine.prepare`, on the submitter's thread); one that did not is
prepared here.

What one request carries can fail only that request: its rejection at admission (`RequestRejected`, or any error
while adding it) fails its submission alone, and a failure of its own inside a step (its grammar; a lower-tier block
it would read is a miss instead) ends it alone with `FinishReason.ERROR`. Anything else that breaks a step is a fault
of the engine itself: the loop fails every request, stops, and reports the error (`alive` turns false, so /health
says so), as it does on a `FatalEngineError` (a tensor-parallel worker died) or `fail()` from another thread (the
workers' watcher); ``on_death`` hears of it once, and a server exits on it.
"""
from __future__ import annotations

import concurrent.futures
import functools
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from engine.kv.block_hashing import BlockHash
from engine.core.api import EngineCoreClient, EngineFacts, OutputSink, StatsListener
from engine.errors import EngineDeadError, RequestRejected
from engine.kv.blocks import CachedPrefix
from engine.core.engine import LLMEngine
from engine.outputs import SchedulerStats, StepOutputs
from engine.multimodal import ImageInput
from engine.requests import EngineRequest

log = logging.getLogger("kvserve.engine")
T = TypeVar("T")


@dataclass
class _Add:
    requests: list[EngineRequest]
    sink: OutputSink
    accepted: concurrent.futures.Future


@dataclass
class _Abort:
    request_id: str
    index: int | None = None


@dataclass
class _Call:
    fn: Callable[[LLMEngine], Any]
    result: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


class _Stop:
    pass


@dataclass
class _Fatal:
    error: BaseException


class EngineLoop(EngineCoreClient):
    """``on_stats`` hears the engine's counters after every step (for /metrics); ``owns_engine``: `shutdown` closes
    the engine too (a server's core; the offline API runs a loop per call on an engine that outlives it)."""

    def __init__(self, engine: LLMEngine, on_stats: StatsListener | None = None,
                 on_death: Callable[[BaseException], None] | None = None, owns_engine: bool = False) -> None:
        self.engine = engine
        self.grammars = engine.structured_outputs
        self.on_stats = on_stats
        self.owns_engine = owns_engine
        self.on_death = on_death  # called once, from whichever thread saw the engine die
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, OutputSink] = {}
        self._thread: threading.Thread | None = None
        self._death_lock = threading.Lock()
        self._error: BaseException | None = None

    @functools.cached_property
    def facts(self) -> EngineFacts:
        return EngineFacts.of(self.engine)

    # ---- any thread ------------------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self.engine.watch_workers(self.fail)
            self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort whatever still runs and stop the thread (then close the engine, if the loop owns it)."""
        if self._thread is not None and self._thread.is_alive():
            self._commands.put(_Stop())
            self._thread.join(timeout)
        if self.owns_engine:
            self.engine.close()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._error is None

    @property
    def error(self) -> BaseException | None:
        """Why the engine died (None while it lives); /health reports it."""
        return self._error

    def fail(self, error: BaseException) -> None:
        """Declare the engine dead (a tensor-parallel worker died): health turns bad at once, and the engine thread
        fails every request and stops at its next command, or as soon as its step in progress fails."""
        self._die(error)
        self._commands.put(_Fatal(error))

    def submit(self, requests: list[EngineRequest], sink: OutputSink) -> concurrent.futures.Future:
        """Queue requests, admitted together (one command, so no step runs between them); the future resolves once
        the engine accepted all of them, or fails with `RequestRejected` (bad input: then none of them runs) or
        `EngineDeadError`."""
        accepted: concurrent.futures.Future = concurrent.futures.Future()
        if not self.alive:
            accepted.set_exception(EngineDeadError("the engine is not running"))
        else:
            self._commands.put(_Add(list(requests), sink, accepted))
        return accepted

    def compile_grammars(self, requests: list[EngineRequest], serialized: list[str | None]) -> None:
        """Cache the requests' grammars on the calling thread (the compiler is thread-safe), so that admitting them
        finds them cached instead of compiling on the engine thread while every stream waits: read from
        ``serialized`` (one per request: what the client's compiler sent, or None), else compiled here. (A server in
        this process compiles them in its handlers already.) One that fails is left to admission, which rejects it."""
        grammars = self.engine.structured_outputs
        for request, grammar in zip(requests, serialized, strict=True):
            spec = request.params.structured_output
            if spec is None:
                continue
            try:
                grammars.compile(spec) if grammar is None else grammars.adopt(spec, grammar)
            except (ValueError, RuntimeError):  # RuntimeError: xgrammar could not read the JSON
                pass

    def abort(self, request_id: str, index: int | None = None) -> None:
        """Finish the request (or one of its sequences) and free its blocks before the next step."""
        self._commands.put(_Abort(request_id, index))

    def num_cached_tokens(self, token_ids: list[int], cache_salt: str | None,
                          images: tuple[ImageInput, ...] = ()) -> concurrent.futures.Future[int]:
        return self.call(lambda engine: engine.num_cached_tokens(token_ids, cache_salt, images))

    def pin(self, token_ids: list[int], cache_salt: str | None, ttl_s: float) -> concurrent.futures.Future[int]:
        return self.call(lambda engine: engine.pin(token_ids, cache_salt, ttl_s))

    def settle_hold(self, request_id: str, keep_s: float) -> concurrent.futures.Future[int]:
        return self.call(lambda engine: engine.settle_hold(request_id, keep_s))

    def stats(self) -> concurrent.futures.Future[SchedulerStats]:
        return self.call(lambda engine: engine.stats())

    def reset_prefix_cache(self) -> concurrent.futures.Future[None]:
        return self.call(lambda engine: engine.reset_prefix_cache())

    def blocks_now(self, block_hashes: list[BlockHash]) -> concurrent.futures.Future[tuple[list[str | None],
                                                                                          list[int]]]:
        def now(engine: LLMEngine) -> tuple[list[str | None], list[int]]:
            cache = engine.scheduler.prefix_cache
            return cache.where_cached(block_hashes), cache.snapshot_points(block_hashes)

        return self.call(now)

    def largest_prefixes(self, limit: int) -> concurrent.futures.Future[tuple[list[CachedPrefix], float]]:
        def largest(engine: LLMEngine) -> tuple[list[CachedPrefix], float]:
            cache = engine.scheduler.prefix_cache
            return cache.cached_prefixes(limit), cache.clock()

        return self.call(largest)

    def call(self, fn: Callable[[LLMEngine], T]) -> concurrent.futures.Future:
        """Run `fn(engine)` on the engine thread between steps: the named queries above, and tests that look inside
        the engine (this core only: code cannot cross to a core in another process)."""
        command = _Call(fn)
        if not self.alive:
            command.result.set_exception(EngineDeadError("the engine is not running"))
        else:
            self._commands.put(command)
        return command.result

    def run_here(self, requests: list[EngineRequest], sink: OutputSink, until: Callable[[], bool]) -> None:
        """Run the engine on the calling thread instead of a thread of its own, from admitting ``requests`` until
        ``until()`` (checked between steps); what still runs then is aborted. For a caller with nothing else to do
        and no core to spare: on a CPU the device is the host's cores, and a second busy Python thread only takes
        the GIL from the steps. Raises `RequestRejected` as `submit`'s future would."""
        self._thread = threading.current_thread()
        accepted: concurrent.futures.Future = concurrent.futures.Future()
        self._handle([_Add(list(requests), sink, accepted)])
        try:
            accepted.result()
            self._run(until)
        finally:
            self._thread = None

    # ---- engine thread -------------------------------------------------------------------------------------------
    def _run(self, until: Callable[[], bool] | None = None) -> None:
        try:
            while until is None or not until():
                idle = not self.engine.has_unfinished_requests()
                if idle and until is not None:  # run_here: everything it admitted has ended
                    break
                commands = [self._commands.get()] if idle else []  # block while there is nothing to compute
                while True:
                    try:
                        commands.append(self._commands.get_nowait())
                    except queue.Empty:
                        break
                if not self._handle(commands):
                    break
                self._step()
        except BaseException as exc:  # the engine state is unusable: fail everyone rather than hang them
            if until is not None and isinstance(exc, KeyboardInterrupt):  # run_here: the caller's own Ctrl-C
                raise
            log.exception("engine loop died")
            self._die(exc)
            self._fail_all(EngineDeadError(f"engine failure: {exc}"))
        finally:
            self.engine.watch_workers(None)
            self._abort_all()
            self._reject_pending()

    def _die(self, error: BaseException) -> None:
        with self._death_lock:
            if self._error is not None:
                return
            self._error = error
        if self.on_death is not None:
            self.on_death(error)

    def _handle(self, commands: list) -> bool:
        """Apply queued commands in order; False on stop."""
        for command in commands:
            if isinstance(command, _Add):
                if command.accepted.set_running_or_notify_cancel():  # else the submitter gave up already
                    self._add(command)
            elif isinstance(command, _Abort):
                self._abort(command.request_id, command.index)
            elif isinstance(command, _Call):
                if not command.result.set_running_or_notify_cancel():
                    continue
                try:
                    command.result.set_result(command.fn(self.engine))
                except Exception as exc:  # noqa: BLE001 - handed to the caller
                    command.result.set_exception(exc)
            elif isinstance(command, _Stop):
                return False
            elif isinstance(command, _Fatal):
                raise command.error
        return True

    def _add(self, command: _Add) -> None:
        try:
            for request in command.requests:  # all of them valid before any is queued
                if not request.prepared:
                    self.engine.prepare(request)
            for request in command.requests:
                self.engine.add(request)
                self._sinks[request.request_id] = command.sink
        except Exception as exc:  # noqa: BLE001 - a rejection (or a failure) of this submission alone
            if not isinstance(exc, RequestRejected):
                log.exception("adding request %s failed", command.requests[0].request_id)
            for request in command.requests:
                self._abort(request.request_id, None)
            command.accepted.set_exception(exc)
            return
        command.accepted.set_result(None)

    def _abort(self, request_id: str, index: int | None) -> None:
        if request_id not in self._sinks:
            return
        self.engine.abort_request(request_id, index)
        if not self.engine.has_request(request_id):
            del self._sinks[request_id]

    def _step(self) -> None:
        if not self.engine.has_unfinished_requests():
            if self.on_stats is not None:
                self.on_stats(self.engine.stats())
            return
        outputs = self.engine.step()  # raising here is an engine fault: `_run` fails everyone and stops
        if self.on_stats is not None:  # before the outputs leave: a client that saw its response sees it counted
            self.on_stats(self.engine.stats())
        self._deliver(outputs)

    def _deliver(self, outputs: StepOutputs) -> None:
        """Hand the step's outputs to their sinks: one `put` per sink per step, however many of its requests ran (a
        server's requests share one sink, so a step crosses to the event loop in one hop, whole)."""
        if not len(outputs):
            return
        sinks, request_ids = self._sinks, outputs.request_ids
        for row, error in outputs.errors.items():
            log.warning("request %s: %s", request_ids[row], error)
        row_sinks = list(map(sinks.get, request_ids))
        only = row_sinks[0]
        if only is not None and len(set(map(id, row_sinks))) == 1:  # one sink has every row: no per-row pass
            self._drop_finished(outputs)
            only.put(outputs)
            return
        rows_of: dict[int, tuple[OutputSink, list[int]]] = {}
        for row, sink in enumerate(row_sinks):
            if sink is not None:
                entry = rows_of.get(id(sink))
                if entry is None:
                    rows_of[id(sink)] = (sink, [row])
                else:
                    entry[1].append(row)
        self._drop_finished(outputs)
        for sink, rows in rows_of.values():
            sink.put(outputs if len(rows) == len(outputs) else outputs.select(rows))

    def _drop_finished(self, outputs: StepOutputs) -> None:
        for row in outputs.finish_reasons:
            request_id = outputs.request_ids[row]
            if not self.engine.has_request(request_id):  # every sequence of it finished (n > 1 may end together)
                self._sinks.pop(request_id, None)

    def _fail_all(self, error: BaseException) -> None:
        for sink in {id(sink): sink for sink in self._sinks.values()}.values():
            sink.put(error)

    def _abort_all(self) -> None:
        for request_id in list(self._sinks):
            self._sinks.pop(request_id)
            try:
                self.engine.abort_request(request_id)
            except Exception:  # noqa: BLE001 - best effort on a broken engine
                log.exception("abort of %s failed", request_id)

    def _reject_pending(self) -> None:
        """Commands that raced the stop: nobody will run them."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            future = command.accepted if isinstance(command, _Add) else getattr(command, "result", None)
            if future is not None and future.set_running_or_notify_cancel():
                future.set_exception(EngineDeadError("the engine stopped"))
