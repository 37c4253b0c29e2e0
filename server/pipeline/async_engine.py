"""The asyncio face of an engine core (`engine.core.api.EngineCoreClient`: the engine thread, or the core in a
process of its own): the server's only way to the engine.

Requests are prepared (validated, block hashes made) before they reach the core, on the caller's thread (the
server's prepare thread: `AsyncEngine.prepare`, from the core's `EngineFacts`). The core hands each step's
`StepOutputs` to the event loop in one hop (one `loop.call_soon_threadsafe` per step, however many requests ran: a
hop costs the engine thread ~20 us); there `_StepDispatcher` routes its rows to the request streams. Each `RequestStream` turns its outputs into text on the event loop with its own `OutputProcessor`
(detokenization and stop strings stay off the engine thread) and stops a sequence in the engine when a stop string
ends it.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from engine.kv.block_hashing import BlockHash
from engine.core.api import EngineCoreClient, EngineFacts
from engine.errors import EngineDeadError
from engine.kv.blocks import CachedPrefix
from engine.text.output_processor import OutputProcessor
from engine.outputs import SchedulerStats, SequenceOutput, StepOutputs
from engine.multimodal import ImageInput
from engine.requests import EngineRequest
from server.http.metrics import Metrics

__all__ = ["AsyncEngine", "EngineDeadError", "EngineRequest", "RequestStream"]


class _StepDispatcher:
    """The output sink of every request submitted from one event loop: each step's outputs cross from the engine
    thread in one `call_soon_threadsafe`, and are routed to their streams on the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.streams: dict[str, RequestStream] = {}  # by engine request id, while the stream runs

    def put(self, item: StepOutputs | BaseException) -> None:
        """From the engine thread."""
        try:
            self.loop.call_soon_threadsafe(self._dispatch, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _dispatch(self, item: StepOutputs | BaseException) -> None:
        if isinstance(item, BaseException):
            for stream in set(self.streams.values()):
                stream.deliver(item)
            self.streams.clear()
            return
        by_stream: dict[RequestStream, list[SequenceOutput]] = {}
        output = item.output
        for row, stream in enumerate(map(self.streams.get, item.request_ids)):
            if stream is not None:
                outs = by_stream.get(stream)
                if outs is None:
                    by_stream[stream] = [output(row)]
                else:
                    outs.append(output(row))
        for stream, outs in by_stream.items():
            stream.deliver(outs)


class RequestStream:
    """The text outputs of submitted engine requests, step by step, until all of their sequences finished."""

    def __init__(self, engine: "AsyncEngine", requests: list[EngineRequest], dispatcher: _StepDispatcher) -> None:
        self.request_ids = [r.request_id for r in requests]
        self._engine = engine
        self._dispatcher = dispatcher
        self._outputs: asyncio.Queue[list[SequenceOutput] | BaseException] = asyncio.Queue()
        self._remaining = sum(r.params.n for r in requests)
        # Finished with a hold (an agent session's): settled when the stream closes, kept `_hold_s` or released.
        self._held = [r.request_id for r in requests if r.retention and r.retention.hold_after_finish_s > 0]
        self._hold_s = 0.0
        self._processor = OutputProcessor(engine.tokenizer)
        self._on_close: list[Callable[[], None]] = []
        for r in requests:
            self._processor.add_request(r.request_id, r.prompt_token_ids, r.params)
            dispatcher.streams[r.request_id] = self

    def deliver(self, item: list[SequenceOutput] | BaseException) -> None:
        """On the event loop: one step's outputs of these requests, or the error that ended the engine."""
        self._outputs.put_nowait(item)

    def __aiter__(self) -> AsyncIterator[list[SequenceOutput]]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[list[SequenceOutput]]:
        while self._remaining:
            item = await self._outputs.get()
            if isinstance(item, BaseException):
                self._finish()  # the engine already dropped the requests
                raise item
            delivered, stopped = self._processor.process(item)
            for request_id, index in stopped:
                self._engine.abort(request_id, index)
            for out in delivered:
                if out.finished:
                    self._remaining -= 1
                    self._engine.observe_finished(out)
            if not self._remaining:
                self._finish()
            if delivered:
                yield delivered

    def hold(self, seconds: float) -> None:
        """Keep the blocks of the requests submitted with a hold ``seconds`` after the stream closes (the reply
        ended in tool calls); by default the close releases them."""
        self._hold_s = seconds

    def on_close(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once, when the stream closes (`abort`)."""
        self._on_close.append(callback)

    def abort(self) -> None:
        """Close the stream (every route handler does, however it ends): stop every unfinished request (the client
        went away), their blocks freed before the next step, and settle the holds (`hold`)."""
        callbacks, self._on_close = self._on_close, []
        for callback in callbacks:
            callback()
        if self._remaining:
            self._engine.observe_aborted(self._remaining)
            self._finish()
            for request_id in self.request_ids:
                self._engine.abort(request_id)
        for request_id in self._held:  # after the aborts: commands apply in order
            self._engine.core.settle_hold(request_id, self._hold_s)
        self._held = []

    def _finish(self) -> None:
        self._remaining = 0
        for request_id in self.request_ids:
            self._dispatcher.streams.pop(request_id, None)


class AsyncEngine:
    """An engine core, for asyncio handlers. ``tokenizer`` detokenizes on the event loop (give it its own instance:
    a Rust tokenizer used from two threads at once can fail with "Already borrowed"); ``metrics`` hears the
    engine's counters after every step."""

    def __init__(self, core: EngineCoreClient, tokenizer: Any, metrics: Metrics | None = None) -> None:
        self.core = core
        self.facts: EngineFacts = core.facts
        self.tokenizer = tokenizer
        self.metrics = metrics
        if metrics is not None:
            core.on_stats = metrics.update
        self._preparer = self.facts.preparer()
        self._dispatchers: dict[asyncio.AbstractEventLoop, _StepDispatcher] = {}  # one per event loop submitting

    def start(self) -> None:
        self.core.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the core, then what outlives it (tensor-parallel workers, the disk tier's writes)."""
        self.core.shutdown(timeout)

    def on_death(self, callback: Callable[[BaseException], None]) -> None:
        """Call ``callback`` (from an engine or watcher thread) once, when the engine dies for good."""
        self.core.on_death = callback

    @property
    def alive(self) -> bool:
        return self.core.alive

    @property
    def error(self) -> BaseException | None:
        return self.core.error

    def prepare(self, requests: list[EngineRequest]) -> None:
        """Validate the requests and make their block hashes, before the core sees them (any thread: the server's
        prepare thread). `RequestRejected`: one could never run."""
        for request in requests:
            self._preparer.prepare(request)

    async def submit(self, requests: list[EngineRequest]) -> RequestStream:
        """Queue requests; returns once the engine accepted all of them. `RequestRejected`: the engine rejected one
        (bad input; none of them runs then)."""
        loop = asyncio.get_running_loop()
        dispatcher = self._dispatchers.get(loop)
        if dispatcher is None:
            dispatcher = self._dispatchers[loop] = _StepDispatcher(loop)
        stream = RequestStream(self, requests, dispatcher)
        try:
            await asyncio.wrap_future(self.core.submit(requests, dispatcher))
        except BaseException:  # rejected, or the client left before admission: undo (commands run in order)
            stream.abort()
            raise
        return stream

    def abort(self, request_id: str, index: int | None = None) -> None:
        self.core.abort(request_id, index)

    def observe_finished(self, out: SequenceOutput) -> None:
        if self.metrics is not None:
            self.metrics.observe_finished(out.finish_reason, out.timings.ttft_s, out.timings.e2e_s)

    def observe_aborted(self, num_sequences: int) -> None:
        if self.metrics is not None:
            for _ in range(num_sequences):
                self.metrics.observe_finished("abort", None, None)

    async def num_cached_tokens(self, token_ids: list[int], cache_salt: str | None,
                                images: tuple[ImageInput, ...] = ()) -> int:
        return await asyncio.wrap_future(self.core.num_cached_tokens(token_ids, cache_salt, images))

    async def pin(self, token_ids: list[int], cache_salt: str | None, ttl_s: float) -> int:
        return await asyncio.wrap_future(self.core.pin(token_ids, cache_salt, ttl_s))

    async def stats(self) -> SchedulerStats:
        return await asyncio.wrap_future(self.core.stats())

    async def blocks_now(self, block_hashes: list[BlockHash]) -> tuple[list[str | None], list[int]]:
        return await asyncio.wrap_future(self.core.blocks_now(block_hashes))

    async def largest_prefixes(self, limit: int) -> tuple[list[CachedPrefix], float]:
        return await asyncio.wrap_future(self.core.largest_prefixes(limit))
