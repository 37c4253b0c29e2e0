"""Grammar compilation in worker processes, with a time limit and a way to cancel it.

Compiling a grammar (the token masks of every state) can take seconds to minutes for a large enum or EBNF, and a
thread running native code can be neither stopped nor timed out. A worker process can: a compile that runs past its
time limit, or whose caller gave up (a client that disconnected, a server shutting down), has its worker killed,
and the next compile starts a fresh one. Each compile has a worker to itself, so killing one never touches another
request's compile. What comes back is the compiled grammar serialized by xgrammar, deserialized by the caller.

The first worker starts on first use (it loads Python, xgrammar with torch, and the vocabulary: several seconds,
which do not count against a compile's time limit) and is kept for the next compile; a killed worker is replaced
at once, in the background. At most ``max_workers`` compile at once; further compiles wait for one.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any

from engine.json_schema_support import clean_error, enforceable_schema
from engine.sampling_params import StructuredOutputSpec

if TYPE_CHECKING:
    import xgrammar
_POLL_S = 0.05  # how often a waiting caller looks at its cancel flag
_START_TIMEOUT_S = 300.0  # a new worker loads Python, xgrammar (and torch) and the vocabulary


class CompileTimeout(ValueError):
    """The grammar did not compile within its time limit (it is too large or too complex to enforce)."""


class CompileCancelled(RuntimeError):
    """The caller gave up on the compile (its client went away, or the server is stopping)."""


def compile_spec(compiler: xgrammar.GrammarCompiler, job: tuple[StructuredOutputSpec, int]) -> xgrammar.CompiledGrammar:
    """Compile one spec with ``compiler`` (in the engine's process or a worker); ``job``: (spec, whitespace
    characters allowed between the tokens of JSON). ValueError when it cannot be compiled."""
    spec, whitespace = job
    try:
        if spec.kind == "json_schema":
            schema = json.dumps(enforceable_schema(_json(spec.value)))
            if whitespace:
                return compiler.compile_json_schema(schema, any_whitespace=True, max_whitespace_cnt=whitespace)
            return compiler.compile_json_schema(schema, any_whitespace=False)  # json.dumps' layout: ", " and ": "
        if spec.kind == "structural_tag":
            return compiler.compile_structural_tag(json.dumps(_with_json_whitespace(_json(spec.value), whitespace)))
        if spec.kind == "regex":
            return compiler.compile_regex(spec.value)
        return compiler.compile_grammar(spec.value)
    except RuntimeError as exc:  # xgrammar reports every grammar error as a RuntimeError subclass
        raise ValueError(f"the {spec.kind.replace('_', ' ')} cannot be enforced: {clean_error(exc)}") from None


def _with_json_whitespace(tag: Any, whitespace: int) -> Any:
    """The structural tag with every JSON part ("json" style) allowing ``whitespace`` characters between tokens;
    with none, a part becomes the grammar of its schema's JSON in one layout, json.dumps' (a structural tag's JSON
    allows at least one whitespace character anywhere)."""
    import xgrammar as xgr

    stack = [tag]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if node.get("type") == "json_schema" and node.get("style", "json") == "json":
                if whitespace:
                    node["max_whitespace_cnt"] = whitespace
                else:
                    compact = xgr.Grammar.from_json_schema(json.dumps(node["json_schema"]), any_whitespace=False)
                    node.clear()
                    node.update(type="grammar", grammar=str(compact))
                continue
            stack.extend(v for v in node.values() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            stack.extend(v for v in node if isinstance(v, (dict, list)))
    return tag


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ValueError(f"the grammar's JSON is not valid: {exc}") from None


def _serve(tokenizer_info_path: str, requests: Connection, replies: Connection) -> None:
    """A worker's loop: load the vocabulary, say "ready", then (spec, whitespace) in, ("ok", serialized grammar) or
    ("error", message) out, until its parent closes the pipe or goes away."""
    import xgrammar as xgr

    parent = os.getppid()

    def exit_with_parent() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=exit_with_parent, daemon=True).start()
    with open(tokenizer_info_path, encoding="utf-8") as f:
        info = xgr.TokenizerInfo.deserialize_json(f.read())
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    replies.send(("ready", None))
    while True:
        try:
            job = requests.recv()
        except EOFError:
            return
        try:
            replies.send(("ok", compile_spec(compiler, job).serialize_json()))
        except ValueError as exc:
            replies.send(("error", str(exc)))


class _Worker:
    """A compile worker: ``python -m engine.worker.grammar_compile`` (not multiprocessing's spawn, which would import the
    caller's main module again), talking over two pipes. It starts in the background: `ready` says when it can
    take a job."""

    def __init__(self, tokenizer_info_path: str) -> None:
        from_parent, to_child = os.pipe()
        from_child, to_parent = os.pipe()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # the parent's modules
        self.process = subprocess.Popen(
            [sys.executable, "-m", "engine.worker.grammar_compile", tokenizer_info_path, str(from_parent), str(to_parent)],
            pass_fds=(from_parent, to_parent), env=env, stdin=subprocess.DEVNULL)
        os.close(from_parent)
        os.close(to_parent)
        self._kill_lock = threading.Lock()
        self._killed = False
        self.requests = Connection(to_child, readable=False)
        self.replies = Connection(from_child, writable=False)
        self.ready = False

    def reply(self, deadline: float, check: Callable[[], None], timeout_message: str) -> tuple[str, Any]:
        """The worker's next message, calling ``check`` while waiting; `CompileTimeout` past ``deadline``."""
        while not wait([self.replies], _POLL_S):
            check()
            if time.monotonic() > deadline:
                raise CompileTimeout(timeout_message)
        try:
            return self.replies.recv()
        except EOFError:  # it died (out of memory, say)
            raise ValueError("the grammar could not be compiled: its compiler process died") from None

    def kill(self) -> None:
        """Once, whoever asks first: the server's close and the compile it interrupts both end the worker, and two
        threads closing one pipe would close another file's descriptor (or fail with EBADF)."""
        with self._kill_lock:
            if self._killed:
                return
            self._killed = True
        self.process.kill()
        self.process.wait(5)
        self.requests.close()
        self.replies.close()


class CompileWorkers:
    """`compile` runs `compile_spec` in a worker within a time limit; ``tokenizer_info_json`` gives the vocabulary
    (xgrammar's serialized `TokenizerInfo`), written once to a private file that new workers read."""

    def __init__(self, tokenizer_info_json: Callable[[], str], max_workers: int = 2) -> None:
        self._tokenizer_info_json = tokenizer_info_json
        self._info_path: str | None = None
        self._idle: list[_Worker] = []
        self._slots = threading.BoundedSemaphore(max_workers)
        self._lock = threading.Lock()
        self._busy: set[_Worker] = set()
        self._closed = False

    def compile(self, job: tuple[StructuredOutputSpec, int], timeout_s: float,
                cancelled: threading.Event | None = None) -> str:
        """The serialized compiled grammar of ``job`` (see `compile_spec`). ValueError: it cannot be compiled;
        `CompileTimeout` past ``timeout_s`` seconds (a new worker's start does not count); `CompileCancelled` once
        ``cancelled`` is set or the workers are closed."""
        check = lambda: self._check(cancelled)  # noqa: E731
        while not self._slots.acquire(timeout=_POLL_S):
            check()
        try:
            worker = self._take()
            try:
                if not worker.ready:
                    worker.reply(time.monotonic() + _START_TIMEOUT_S, check, "a grammar compile worker did not start")
                    worker.ready = True
                worker.requests.send(job)
                status, payload = worker.reply(time.monotonic() + timeout_s, check, f"compiling the grammar took "
                                               f"longer than {timeout_s:g} s: it is too large or too complex")
            except BaseException:
                self._discard(worker)
                if self._closed:
                    raise CompileCancelled("the server is stopping") from None
                raise
            self._give_back(worker)
        finally:
            self._slots.release()
        if status == "error":
            raise ValueError(payload)
        return payload

    def close(self) -> None:
        """Kill every worker; compiles in progress end with `CompileCancelled`."""
        with self._lock:
            self._closed = True
            workers, self._idle = [*self._idle, *self._busy], []
        for worker in workers:
            worker.kill()
        if self._info_path is not None:
            os.unlink(self._info_path)
            self._info_path = None

    def _check(self, cancelled: threading.Event | None) -> None:
        if self._closed:
            raise CompileCancelled("the server is stopping")
        if cancelled is not None and cancelled.is_set():
            raise CompileCancelled("the request was cancelled")

    def _take(self) -> _Worker:
        with self._lock:
            if self._closed:
                raise CompileCancelled("the server is stopping")
            worker = self._idle.pop() if self._idle else self._start()
            self._busy.add(worker)
            return worker

    def _start(self) -> _Worker:
        if self._info_path is None:
            fd, self._info_path = tempfile.mkstemp(prefix="kvserve-vocab-", suffix=".json")  # mode 0600
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(self._tokenizer_info_json())
        return _Worker(self._info_path)

    def _give_back(self, worker: _Worker) -> None:
        with self._lock:
            self._busy.discard(worker)
            if self._closed:
                worker.kill()
            else:
                self._idle.append(worker)

    def _discard(self, worker: _Worker) -> None:
        """Kill a worker that timed out, was cancelled or broke; a fresh one starts now for the next compile."""
        with self._lock:
            self._busy.discard(worker)
            if not self._closed:
                self._idle.append(self._start())
        worker.kill()


if __name__ == "__main__":  # a worker, started by `_Worker`
    _serve(sys.argv[1], Connection(int(sys.argv[2]), writable=False), Connection(int(sys.argv[3]), readable=False))
