"""Grammars a request can run without, compiled in the background instead of on its path.

Under `tool_choice: "auto"` the model may answer in text; the tool-call grammar only keeps a call it opens valid, so
nothing is promised without it. An agent's 20+ tools can take minutes to compile on a few cores (Claude Code's: 94 s
on one), longer than a request should wait (`--grammar-compile-timeout`). So such a request never waits for its
grammar: when its tenant has not compiled it yet, the request runs unconstrained at once (as it would after a
timed-out compile) while the grammar compiles in the background, within `--grammar-background-compile-timeout`, to
be cached for that tenant's next request with the same tools. One compile runs at a time (it holds a CPU core), a
few more may queue; a grammar that failed or timed out is remembered for `FAILURE_TTL_S`, so the same tools are not
compiled again on every turn. Closing drops the queue; the compile in progress ends when the workers close.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

from engine.sampling_params import StructuredOutputSpec
from engine.worker.grammar_compile import CompileCancelled
from engine.worker.structured_output import StructuredOutputs

log = logging.getLogger("kvserve.server")

FAILURE_TTL_S = 3600.0  # a grammar that failed to compile is not tried again for this long (per tenant)
MAX_QUEUED = 16  # compiles waiting for the background thread; beyond this a request's grammar is not queued
_MAX_FAILURES = 1024  # failures remembered; the oldest is forgotten first

_Key = tuple[StructuredOutputSpec, "str | None"]  # (grammar, tenant): a tenant's cache is its own


class OptionalGrammars:
    """`missing` says whether a tenant's optional grammar is cached, and starts its compile in the background when it
    is not."""

    def __init__(self, grammars: StructuredOutputs, failure_ttl_s: float = FAILURE_TTL_S) -> None:
        self._grammars = grammars
        self.failure_ttl_s = failure_ttl_s
        self._lock = threading.Lock()
        self._queued: set[_Key] = set()  # waiting or compiling
        self._failures: OrderedDict[_Key, tuple[float, str]] = OrderedDict()  # key -> (when, why)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-grammar-background")

    def missing(self, spec: StructuredOutputSpec, tenant: str | None, timeout_s: float) -> str | None:
        """None when ``tenant`` has ``spec`` compiled (the engine finds it cached); else why its request runs without
        it. A grammar neither queued nor failed within the last `failure_ttl_s` starts compiling in the background,
        within ``timeout_s`` seconds."""
        if self._grammars.is_cached(spec, tenant):
            return None
        key = (spec, tenant)
        with self._lock:
            failed = self._failures.get(key)
            if failed is not None and time.monotonic() - failed[0] < self.failure_ttl_s:
                return f"its grammar did not compile, tried again after {self.failure_ttl_s:g} s: {failed[1]}"
            self._failures.pop(key, None)
            if key in self._queued:
                return "its grammar is compiling in the background"
            if len(self._queued) >= MAX_QUEUED:
                return f"{MAX_QUEUED} grammars are compiling in the background already; a later request queues it"
            self._queued.add(key)
        try:
            self._thread.submit(self._compile, key, timeout_s)
        except RuntimeError:  # closed: the server is stopping
            self._done(key)
            return "the server is stopping"
        return "its grammar is compiling in the background, for the next request with the same tools"

    def close(self) -> None:
        """Drop the queued compiles (the one in progress ends when the grammar workers close) without waiting."""
        self._thread.shutdown(wait=False, cancel_futures=True)

    def _compile(self, key: _Key, timeout_s: float) -> None:
        spec, tenant = key
        try:
            self._grammars.compile_isolated(spec, timeout_s, scope=tenant)
        except CompileCancelled:
            pass  # the server is stopping
        except ValueError as exc:  # CompileTimeout too
            log.warning("an optional grammar did not compile in the background (not tried again for %g s): %s",
                        self.failure_ttl_s, exc)
            with self._lock:
                self._failures[key] = (time.monotonic(), str(exc))
                while len(self._failures) > _MAX_FAILURES:
                    self._failures.popitem(last=False)
        finally:
            self._done(key)

    def _done(self, key: _Key) -> None:
        with self._lock:
            self._queued.discard(key)
