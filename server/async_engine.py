"""The engine thread: one background thread owns the (not thread-safe) `LLMEngine`; asyncio handlers talk to it
only through a thread-safe command queue one way and `loop.call_soon_threadsafe` into per-request asyncio queues
the other way.

The loop blocks on the command queue while the engine is idle (no spinning), and drains every queued command
before each step, so requests that arrive together are admitted together and batched by the scheduler.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from engine.llm_engine import LLMEngine, SequenceOutput
from engine.sampling_params import SamplingParams
from server.metrics import EngineSnapshot, Metrics

log = logging.getLogger("kvserve.engine")
T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The engine failed while running a request; the request cannot finish."""


@dataclass
class EngineRequest:
    """One engine request: a prompt with its sampling parameters and cache salt."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None


@dataclass
class _Sink:
    """Where one engine request's outputs go: an asyncio queue on the loop that submitted it (shared by the engine
    requests of one HTTP request, so their outputs arrive merged in step order)."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    n: int
    num_finished: int = 0

    def put(self, item: list[SequenceOutput] | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


@dataclass
class _Add:
    request: EngineRequest
    sink: _Sink
    accepted: asyncio.Future


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    fn: Callable[[LLMEngine], Any]
    result: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


class _Stop:
    pass


def _resolve(future: asyncio.Future, result: Any = None, error: BaseException | None = None) -> None:
    """Complete `future` on its own loop, unless its awaiter already gave up (cancelled)."""

    def settle() -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    try:
        future.get_loop().call_soon_threadsafe(settle)
    except RuntimeError:
        pass


class RequestStream:
    """The outputs of submitted engine requests, step by step, until all of their sequences finished."""

    def __init__(self, engine: "AsyncEngine", request_ids: list[str], outputs: asyncio.Queue, num_seqs: int) -> None:
        self.request_ids = request_ids
        self._engine = engine
        self._outputs = outputs
        self._remaining = num_seqs

    @property
    def finished(self) -> bool:
        return not self._remaining

    def __aiter__(self) -> AsyncIterator[list[SequenceOutput]]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[list[SequenceOutput]]:
        while self._remaining:
            item = await self._outputs.get()
            if isinstance(item, BaseException):
                self._remaining = 0  # the engine already dropped the requests
                raise item
            self._remaining -= sum(out.finished for out in item)
            yield item

    def abort(self) -> None:
        """Stop every unfinished request (the client went away); their pages are freed before the next step."""
        if self._remaining:
            self._remaining = 0
            for request_id in self.request_ids:
                self._engine.abort(request_id)


class AsyncEngine:
    """The asyncio face of an `LLMEngine` running in its own thread."""

    def __init__(self, engine: LLMEngine, metrics: Metrics | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, _Sink] = {}
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None  # set when the loop died; /health reports it

    # ---- handler side (any thread / event loop) -----------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort whatever still runs and stop the thread."""
        if self._thread is not None and self._thread.is_alive():
            self._commands.put(_Stop())
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    async def submit(self, requests: list[EngineRequest]) -> RequestStream:
        """Queue requests; returns once the engine accepted all of them. ValueError: the engine rejected one (bad
        input; none of them runs then)."""
        if not self.alive:
            raise EngineDeadError("the engine is not running")
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()
        accepted = []
        for request in requests:
            future = loop.create_future()
            self._commands.put(_Add(request, _Sink(loop, outputs, request.params.n), future))
            accepted.append(future)
        stream = RequestStream(self, [r.request_id for r in requests], outputs, sum(r.params.n for r in requests))
        try:
            await asyncio.gather(*accepted)
        except BaseException:  # rejected, or the client left before admission: undo (commands run in order)
            stream.abort()
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Finish the request now and free its pages (the engine does it before its next step)."""
        self._commands.put(_Abort(request_id))

    def call(self, fn: Callable[[LLMEngine], T]) -> concurrent.futures.Future:
        """Run `fn(engine)` on the engine thread between steps (consistent reads; tests, diagnostics)."""
        command = _Call(fn)
        if not self.alive:
            command.result.set_exception(EngineDeadError("the engine is not running"))
            return command.result
        self._commands.put(command)
        return command.result

    # ---- engine thread --------------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                idle = not self.engine.has_unfinished_requests()
                commands = [self._commands.get()] if idle else []  # block while there is nothing to compute
                while True:
                    try:
                        commands.append(self._commands.get_nowait())
                    except queue.Empty:
                        break
                if not self._handle(commands):
                    break
                if self.engine.has_unfinished_requests():
                    self._step()
                else:
                    self._publish()
        except BaseException as exc:  # the engine state is unusable: fail everyone rather than hang them
            log.exception("engine loop died")
            self.error = exc
            self._fail_all(EngineDeadError(f"engine failure: {exc!r}"))
        finally:
            self._abort_all()
            self._reject_pending()

    def _handle(self, commands: list) -> bool:
        """Apply queued commands in order; False on stop."""
        for command in commands:
            if isinstance(command, _Add):
                request = command.request
                try:
                    self.engine.add_request(
                        request.request_id, request.prompt_token_ids, request.params, request.cache_salt
                    )
                except ValueError as exc:
                    _resolve(command.accepted, error=exc)
                    continue
                self._sinks[request.request_id] = command.sink
                _resolve(command.accepted)
            elif isinstance(command, _Abort):
                sink = self._sinks.pop(command.request_id, None)
                if sink is not None:
                    self.engine.abort_request(command.request_id)
                    if self.metrics is not None:
                        for _ in range(sink.n - sink.num_finished):
                            self.metrics.observe_finished("abort", None, None)
            elif isinstance(command, _Call):
                try:
                    command.result.set_result(command.fn(self.engine))
                except Exception as exc:  # noqa: BLE001 - handed to the caller
                    command.result.set_exception(exc)
            elif isinstance(command, _Stop):
                return False
        return True

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - one bad batch must not take the server down
            log.exception("engine step failed; aborting the running requests")
            self._fail_all(EngineDeadError(f"engine step failed: {exc!r}"))
            self._abort_all()
            return
        self._publish()  # before the outputs leave: a client that saw its response sees it in /metrics too
        by_request: dict[str, list[SequenceOutput]] = {}
        for out in outputs:
            by_request.setdefault(out.request_id, []).append(out)
            if out.finished and self.metrics is not None:
                self.metrics.observe_finished(out.finish_reason or "abort", out.timings.ttft_s, out.timings.e2e_s)
            if out.error:
                log.warning("request %s: %s", out.request_id, out.error)
        for request_id, outs in by_request.items():
            sink = self._sinks.get(request_id)
            if sink is None:
                continue
            sink.put(outs)
            sink.num_finished += sum(out.finished for out in outs)
            if sink.num_finished >= sink.n:
                del self._sinks[request_id]

    def _publish(self) -> None:
        if self.metrics is None:
            return
        engine, kv = self.engine, self.engine.kv
        self.metrics.update(EngineSnapshot(
            prefix_cache_queries_tokens=kv.stats.queries,
            prefix_cache_hits_tokens=kv.stats.hits,
            prefix_cache_evictions=kv.stats.evictions,
            kv_pages_total=kv.num_pages,
            kv_pages_free=kv.num_free_pages,
            kv_pages_cached=kv.num_cached_pages,
            requests_running=len(engine.scheduler.running),
            requests_waiting=len(engine.scheduler.waiting),
            prompt_tokens=engine.num_prompt_tokens,
            generation_tokens=engine.num_generation_tokens,
            preemptions=engine.scheduler.num_preemptions,
        ))

    def _fail_all(self, error: BaseException) -> None:
        for sink in self._sinks.values():
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
            if isinstance(command, _Add):
                _resolve(command.accepted, error=EngineDeadError("the engine stopped"))
            elif isinstance(command, _Call):
                command.result.set_exception(EngineDeadError("the engine stopped"))
