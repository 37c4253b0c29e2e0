"""The engine core in a process of its own (`kvserve serve --engine-process on`, the default on CUDA): HTTP,
rendering, detokenization and parsing in the server's process never share a GIL with the step.

`CoreProcess` is the client's side, an `EngineCoreClient`: it spawns the child (multiprocessing, spawn), which builds
the `LLMEngine` from the same model and `EngineConfig` and runs an `EngineLoop` in it; commands go over one ZMQ
PUSH socket, answers and outputs come back over another, as msgpack (engine/core/wire.py: each step's
`StepOutputs` is one message, its columns as bytes). A receiver thread hands each step to its sink in one `put`, as
the engine thread does in-process. Requests arrive prepared (validated, block hashes made on the client's side).

The child's stderr is forwarded to ours line by line and its tail is kept: a child that fails to start (an error,
a crash, or no answer within ``startup_timeout_s``) raises `CoreStartError` with it. A child that dies later (killed,
crashed, or its engine failed) is an engine death: `alive` turns false, every sink and pending query fails with
`EngineDeadError`, and ``on_death`` is called once, so a server answers /health with 503 and exits. The child exits
with its parent, and ignores SIGINT/SIGTERM: the parent drains first, then stops it.
"""
from __future__ import annotations

import atexit
import collections
import concurrent.futures
import itertools
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp
import zmq

from engine.core import wire
from engine.kv.block_hashing import BlockHash
from engine.config import EngineConfig
from engine.core.api import QUERIES, EngineCoreClient, EngineFacts, OutputSink, StatsListener
from engine.errors import EngineDeadError
from engine.kv.blocks import CachedPrefix
from engine.outputs import SchedulerStats, StepOutputs
from engine.core.processes import caller_script_hidden, exit_with_parent
from engine.multimodal import ImageInput
from engine.requests import EngineRequest
from engine.worker.structured_output import StructuredOutputs

log = logging.getLogger("kvserve.engine")
STARTUP_TIMEOUT_S = 1800.0  # building a large model's engine (weights, KV pool) takes minutes, not hours
POLL_MS = 100  # how often the receiver looks at the child's process while no message comes
STOP_TIMEOUT_S = 30.0
STDERR_TAIL_LINES = 40


class CoreStartError(RuntimeError):
    """The engine core process did not start; the message carries its error or its stderr's last lines."""


class CoreProcess(EngineCoreClient):
    """Spawns the core process and waits until its engine is built (its `EngineFacts` arrive), or raises
    `CoreStartError`. Messages are handled from `start` on."""

    def __init__(self, model_dir: Path, cfg: EngineConfig, model_id: str | None = None,
                 startup_timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        self.on_death: Callable[[BaseException], None] | None = None
        self.on_stats: StatsListener | None = None
        self._error: BaseException | None = None
        self._death_lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._sinks: dict[int, OutputSink] = {}  # by sink id (id() of the sink)
        self._decoders: dict[int, wire.StepDecoder] = {}  # by sink id (receiver thread)
        self._calls: dict[int, tuple[concurrent.futures.Future, str]] = {}  # by call id: the future, the query
        self._call_ids = itertools.count()
        self._started = self._closing = False
        self._receiver: threading.Thread | None = None
        self._dir = tempfile.mkdtemp(prefix="kvserve-core-")
        self._zmq = zmq.Context()
        self._commands = self._bind(zmq.PUSH, "commands")
        self._outputs = self._bind(zmq.PULL, "outputs")
        stderr_reader, stderr_writer = mp.get_context("spawn").Pipe(duplex=False)
        self._stderr = _StderrForwarder(stderr_reader)
        self._process = mp.get_context("spawn").Process(
            target=run_core, name="kvserve-core", daemon=False,  # a daemonic process could not start TP workers
            args=(Path(model_dir), cfg, model_id, self._address("commands"), self._address("outputs"), stderr_writer,
                  logging.getLogger().getEffectiveLevel()))
        with caller_script_hidden():
            self._process.start()
        stderr_writer.close()
        try:
            self.facts: EngineFacts = self._wait_ready(startup_timeout_s)
        except BaseException:
            self._kill()
            self._release()
            raise
        from engine.text.tokenizer_load import load_tokenizer

        # This side's grammar compiler (its tokenizer is the engine's): what it compiled travels with the requests as
        # JSON, so the core reads it instead of compiling it again.
        self.grammars = StructuredOutputs(load_tokenizer(model_dir), self.facts.vocab_size,
                                          self.facts.eos_token_ids, "cpu", cfg.json_whitespace)
        # An interpreter that exits without a shutdown (a script's error) would otherwise join the child forever.
        atexit.register(self.shutdown)

    # ---- EngineCoreClient --------------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._receiver is None:
            self._started = True
            self._receiver = threading.Thread(target=self._receive, name="kvserve-core-receiver", daemon=True)
            self._receiver.start()

    def shutdown(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Stop the child (it aborts what still runs and closes its engine), then the receiver."""
        if self._closing:
            return
        self._closing = True
        atexit.unregister(self.shutdown)
        if self._process.is_alive():
            try:
                self._send(["stop"])
            except zmq.ZMQError:
                pass
            self._process.join(timeout)
        self._kill()
        if self._receiver is not None:
            self._receiver.join(timeout)
        self._fail_pending(EngineDeadError("the engine stopped"))
        self._release()

    @property
    def alive(self) -> bool:
        return self._started and not self._closing and self._error is None

    @property
    def error(self) -> BaseException | None:
        return self._error

    def submit(self, requests: list[EngineRequest], sink: OutputSink) -> concurrent.futures.Future[None]:
        if id(sink) not in self._sinks:
            self._sinks[id(sink)], self._decoders[id(sink)] = sink, wire.StepDecoder()
        grammars = [None if r.params.structured_output is None else self.grammars.serialized(r.params.structured_output)
                    for r in requests]
        return self._call("add", lambda call: ["add", call, id(sink), [wire.encode_request(r) for r in requests],
                                               grammars])

    def abort(self, request_id: str, index: int | None = None) -> None:
        if self.alive:
            self._send(["abort", request_id, index])

    def num_cached_tokens(self, token_ids: list[int], cache_salt: str | None,
                          images: tuple[ImageInput, ...] = ()) -> concurrent.futures.Future[int]:
        return self._query("num_cached_tokens", token_ids, cache_salt, wire.encode_images(images))

    def pin(self, token_ids: list[int], cache_salt: str | None, ttl_s: float) -> concurrent.futures.Future[int]:
        return self._query("pin", token_ids, cache_salt, ttl_s)

    def settle_hold(self, request_id: str, keep_s: float) -> concurrent.futures.Future[int]:
        return self._query("settle_hold", request_id, keep_s)

    def stats(self) -> concurrent.futures.Future[SchedulerStats]:
        return self._query("stats")

    def reset_prefix_cache(self) -> concurrent.futures.Future[None]:
        return self._query("reset_prefix_cache")

    def blocks_now(self, block_hashes: list[BlockHash]) -> concurrent.futures.Future[tuple[list[str | None],
                                                                                          list[int]]]:
        return self._query("blocks_now", block_hashes)

    def largest_prefixes(self, limit: int) -> concurrent.futures.Future[tuple[list[CachedPrefix], float]]:
        return self._query("largest_prefixes", limit)

    @property
    def pid(self) -> int | None:
        return self._process.pid

    @property
    def exitcode(self) -> int | None:
        """The core process's exit status once it ended (0: stopped by `shutdown`), else None."""
        return self._process.exitcode

    # ---- internals -----------------------------------------------------------------------------------------------
    def _address(self, name: str) -> str:
        return f"ipc://{self._dir}/{name}"

    def _bind(self, kind: int, name: str) -> zmq.Socket:
        socket = self._zmq.socket(kind)
        socket.setsockopt(zmq.LINGER, 0)
        socket.bind(self._address(name))
        return socket

    def _send(self, message: list) -> None:
        data = wire.pack(message)
        with self._send_lock:
            self._commands.send(data)

    def _query(self, name: str, *args: Any) -> concurrent.futures.Future:
        return self._call(name, lambda call: ["query", call, name, list(args)])

    def _call(self, name: str, message: Callable[[int], list]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        if not self.alive:
            future.set_exception(EngineDeadError("the engine is not running"))
            return future
        call = next(self._call_ids)
        self._calls[call] = (future, name)
        self._send(message(call))
        if self._error is not None and self._calls.pop(call, None) is not None:  # it died meanwhile
            future.set_exception(EngineDeadError(str(self._error)))
        return future

    def _wait_ready(self, timeout_s: float) -> EngineFacts:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._outputs.poll(POLL_MS):
                message = wire.unpack(self._outputs.recv())
                if message[0] == "ready":
                    return wire.decode_facts(message[1])
                if message[0] == "failed":
                    raise CoreStartError(f"the engine core process could not build the engine:\n{message[1]}")
            elif self._process.exitcode is not None:
                self._stderr.join(2.0)
                raise CoreStartError(f"the engine core process {_how_it_ended(self._process.exitcode)} while "
                                     f"starting{self._stderr.tail_text()}")
        raise CoreStartError(f"the engine core process did not start within {timeout_s:g}s (raise "
                             f"--engine-process-timeout for a model this large, or serve with --engine-process off)"
                             f"{self._stderr.tail_text()}")

    def _receive(self) -> None:
        """The receiver thread: every message from the child, until it stops or dies."""
        sinks, outputs, decoders = self._sinks, self._outputs, self._decoders
        try:
            while True:
                if not outputs.poll(POLL_MS):
                    if self._process.exitcode is not None:
                        break
                    continue
                message = wire.unpack(outputs.recv())
                kind = message[0]
                if kind == "step":
                    step = decoders[message[1]].decode(message[2])  # decoded even for a sink gone: its state
                    sink = sinks.get(message[1])
                    if sink is not None:
                        sink.put(step)
                elif kind == "stats":
                    if self.on_stats is not None:
                        self.on_stats(wire.decode_result("stats", message[1]))
                elif kind == "reply":
                    self._reply(message)
                elif kind == "fail":
                    sink = sinks.get(message[1])
                    if sink is not None:
                        sink.put(EngineDeadError(message[2]))
                elif kind == "dead":
                    self._die(EngineDeadError(message[1]))
        except zmq.ZMQError:  # the sockets closed under us: shutting down
            if not self._closing:
                raise
        except Exception as exc:  # noqa: BLE001 - a message we cannot read: fail loudly rather than hang everyone
            log.exception("reading the engine core's messages failed")
            self._die(EngineDeadError(f"the engine core's messages could not be read: {exc!r}"))
            self._kill()
            return
        if not self._closing:
            self._process.join(1.0)
            self._die(EngineDeadError(f"the engine core process (pid {self._process.pid}) "
                                      f"{_how_it_ended(self._process.exitcode)}"))

    def _reply(self, message: list) -> None:
        entry = self._calls.pop(message[1], None)
        if entry is None:
            return
        future, name = entry
        if message[2]:
            future.set_result(wire.decode_result(name, message[3]))
        else:
            future.set_exception(wire.decode_error(message[3], message[4]))

    def _die(self, error: BaseException) -> None:
        """Once: fail every sink and pending call, then tell ``on_death``."""
        with self._death_lock:
            if self._error is not None:
                return
            self._error = error
        self._fail_pending(error)
        log.error("%s", error)
        if self.on_death is not None:
            self.on_death(error)

    def _fail_pending(self, error: BaseException) -> None:
        for sink in list(self._sinks.values()):
            sink.put(error)
        for call in list(self._calls):
            entry = self._calls.pop(call, None)
            if entry is not None and not entry[0].done():
                entry[0].set_exception(error)

    def _kill(self) -> None:
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5.0)

    def _release(self) -> None:
        self._commands.close()
        self._outputs.close()
        self._zmq.term()
        shutil.rmtree(self._dir, ignore_errors=True)


def _how_it_ended(exitcode: int | None) -> str:
    if exitcode is None:
        return "stopped answering"
    if exitcode < 0:
        return f"was killed by {signal.Signals(-exitcode).name}"
    return f"exited with code {exitcode}"


class _StderrForwarder:
    """Copies the child's stderr to ours as it comes, keeping its last lines for an error message."""

    def __init__(self, reader: Connection) -> None:
        self._reader = reader
        self._tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)
        self._thread = threading.Thread(target=self._forward, name="kvserve-core-stderr", daemon=True)
        self._thread.start()

    def _forward(self) -> None:
        pending = b""
        fd = self._reader.fileno()
        while chunk := os.read(fd, 65536):
            try:
                sys.stderr.write(chunk.decode("utf-8", "replace"))
                sys.stderr.flush()
            except (ValueError, OSError):  # our stderr closed (interpreter exit)
                pass
            *lines, pending = (pending + chunk).split(b"\n")
            self._tail.extend(line.decode("utf-8", "replace") for line in lines)
        self._reader.close()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def tail_text(self) -> str:
        if not self._tail:
            return " (it wrote nothing to stderr)"
        return ("; the last lines of its stderr:\n" + "\n".join(f"  | {line}" for line in self._tail))


# ---- the child --------------------------------------------------------------------------------------------------------
def run_core(model_dir: Path, cfg: EngineConfig, model_id: str | None, commands_address: str,
             outputs_address: str, stderr: Connection, log_level: int = logging.INFO) -> None:
    """The core process's entry point: build the engine, report its facts, then serve commands until told to stop
    (exit 0) or the engine dies (exit 1)."""
    os.dup2(stderr.fileno(), 2)
    stderr.close()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the parent drains, then stops us
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    exit_with_parent()
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s: %(message)s")  # as the parent logs
    context = zmq.Context()
    outputs = context.socket(zmq.PUSH)
    outputs.connect(outputs_address)
    commands = context.socket(zmq.PULL)
    commands.connect(commands_address)
    core = _CoreServer(outputs)
    try:
        from engine.core.loop import EngineLoop
        from engine.core.engine import LLMEngine

        loop = EngineLoop(LLMEngine(model_dir, cfg, model_id=model_id), owns_engine=True)
        facts = loop.facts
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
        core.send(["failed", traceback.format_exc()])
        _flush_and_exit(context, 1)
    loop.on_stats = core.send_stats
    loop.on_death = core.send_death
    loop.start()
    core.send(["ready", wire.encode_facts(facts)])
    stopped = core.serve(loop, commands)
    loop.shutdown()
    if not stopped:
        _flush_and_exit(context, 1)
    context.destroy(linger=5000)  # stopped: a normal exit, whose finalizers release what the engine registered


def _flush_and_exit(context: zmq.Context, code: int) -> None:
    """Send what is queued (the parent may be gone: give up after a few seconds), then exit without the
    interpreter's teardown (a broken engine's threads may still hold its locks)."""
    context.destroy(linger=5000)
    os._exit(code)


class _RemoteSink:
    """An `OutputSink` in the child for one sink of the client: each step's outputs as one message (put from the
    engine thread)."""

    def __init__(self, core: _CoreServer, sink_id: int, is_live: Callable[[str], bool]) -> None:
        self.core = core
        self.sink_id = sink_id
        self.encoder = wire.StepEncoder(is_live)

    def put(self, item: StepOutputs | BaseException) -> None:
        if isinstance(item, BaseException):
            self.core.send(["fail", self.sink_id, str(item)])
        else:
            self.core.send(["step", self.sink_id, self.encoder.encode(item)])


class _CoreServer:
    """The child's side of the sockets: applies the client's commands to its `EngineLoop` and sends what comes back
    (from the engine thread, the main thread and a watcher thread alike: sends hold a lock)."""

    def __init__(self, outputs: zmq.Socket) -> None:
        self._outputs = outputs
        self._lock = threading.Lock()
        self._sinks: dict[int, _RemoteSink] = {}

    def send(self, message: list) -> None:
        data = wire.pack(message)
        with self._lock:
            self._outputs.send(data)

    def send_stats(self, stats: SchedulerStats) -> None:
        self.send(["stats", wire.encode_result("stats", stats)])

    def send_death(self, error: BaseException) -> None:
        self.send(["dead", f"engine failure: {error}"])

    def serve(self, loop, commands: zmq.Socket) -> bool:
        """Until a stop (True) or the engine's death (False)."""
        while loop.alive:
            if not commands.poll(POLL_MS):
                continue
            message = wire.unpack(commands.recv())
            kind = message[0]
            if kind == "add":
                _, call, sink_id, requests, grammars = message
                sink = self._sinks.get(sink_id)
                if sink is None:
                    sink = self._sinks[sink_id] = _RemoteSink(self, sink_id, loop.engine.has_request)
                prepared = [wire.decode_request(r) for r in requests]
                loop.compile_grammars(prepared, grammars)  # here, not on the engine thread (commands wait, steps go on)
                self._answer(call, "add", loop.submit(prepared, sink))
            elif kind == "abort":
                loop.abort(message[1], message[2])
            elif kind == "query":
                _, call, name, args = message
                if name not in QUERIES:
                    raise ValueError(f"unknown query {name!r}")
                if name == "num_cached_tokens":  # its images travel encoded
                    args[2] = wire.decode_images(args[2])
                self._answer(call, name, getattr(loop, name)(*args))
            elif kind == "stop":
                return True
        return False

    def _answer(self, call: int, name: str, future: concurrent.futures.Future) -> None:
        def reply(done: concurrent.futures.Future) -> None:
            error = done.exception()
            if error is None:
                self.send(["reply", call, True, wire.encode_result(name, done.result())])
            else:
                self.send(["reply", call, False, type(error).__name__, str(error)])

        future.add_done_callback(reply)
