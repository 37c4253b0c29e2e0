"""`kvserve serve --record FILE.jsonl`: one JSON line per finished request, for replay by the prefix-cache benchmark
(`kvserve bench replay|simulate --trace FILE.jsonl`, see benchmarks/prefix/traces/replay.py).

Each line: `body` (the request as the client sent it), `prompt_token_ids` (exactly what the engine prefilled),
`output_token_ids` (choice 0), `cached_tokens`, `cache_salt` (the effective salt: a tenant hash, never an API key),
`session` (the agent session the client named: `prompt_cache_key`, Claude Code's session id; see server/cache/session.py),
`timings` (seconds), `speculation` (speculative decoding's counters for choice 0: drafts, accepted, acceptance rate,
mean accepted length, tokens per step; null when it did not speculate), plus `request_id`, `endpoint`, `model`, `finish_reason` and `time` (unix seconds). A batched
text completion writes one line per prompt.

A path with `{salt}` writes one file per cache salt (a tenant, or an end user behind a request `cache_salt`): the
placeholder becomes a hash of the salt (`shared` without one), so that each tenant's traffic can be handed to it
alone. Files are created readable by their owner only (they hold prompts). At most 64 stay open at once, and a
failed write (a full disk) drops its record with a warning: recording never fails a request.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from engine.outputs import RequestTimings


@dataclass
class RequestRecord:
    request_id: str
    endpoint: str
    model: str
    body: dict[str, Any]
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    cached_tokens: int
    cache_salt: str | None
    session: str | None
    finish_reason: str | None
    timings: dict[str, float | None]
    time: float
    speculation: dict[str, float] | None = None  # speculative decoding: acceptance rate, mean accepted length, ...


def timing_fields(timings: RequestTimings | None) -> dict[str, float | None]:
    if timings is None:
        return {}
    return {"queue_s": timings.queue_s, "ttft_s": timings.ttft_s, "e2e_s": timings.e2e_s}


SALT_PLACEHOLDER = "{salt}"
MAX_OPEN_FILES = 64  # descriptors a `{salt}` recorder keeps open at once
log = logging.getLogger("kvserve.server")


class Recorder:
    """Appends records to a JSONL file (one per cache salt when the path has `{salt}`); one line per write, in one
    `write` call on an append-only descriptor, so a crash loses at most the line in flight. At most
    ``max_open_files`` descriptors stay open (the least recently written is closed first and reopened when its
    salt writes again), so many salts cannot use up the process's descriptors. Recording never fails a request: a
    write that fails (a full disk, a file that cannot be opened) is dropped, counted and logged (once, then once
    when writes work again)."""

    def __init__(self, path: str | Path, max_open_files: int = MAX_OPEN_FILES) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.max_open_files = max_open_files
        self.dropped = 0  # records lost to failed writes
        self._fds: OrderedDict[Path, int] = OrderedDict()
        self._lock = threading.Lock()
        if SALT_PLACEHOLDER not in str(path):
            self._fd_for(None)  # created at once, so a bad path fails at start-up

    def _path_for(self, salt: str | None) -> Path:
        if SALT_PLACEHOLDER not in str(self.path):
            return self.path
        name = "shared" if salt is None else hashlib.sha256(salt.encode()).hexdigest()[:16]
        return Path(str(self.path).replace(SALT_PLACEHOLDER, name))

    def _fd_for(self, salt: str | None) -> int:
        path = self._path_for(salt)
        fd = self._fds.get(path)
        if fd is not None:
            self._fds.move_to_end(path)
            return fd
        while len(self._fds) >= self.max_open_files:
            os.close(self._fds.popitem(last=False)[1])
        fd = self._fds[path] = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        return fd

    def write(self, record: RequestRecord) -> None:
        try:
            line = (json.dumps(asdict(record), ensure_ascii=False) + "\n").encode("utf-8", "surrogatepass")
            with self._lock:
                written = os.write(self._fd_for(record.cache_salt), line)
            if written != len(line):
                raise OSError(f"wrote {written} of {len(line)} bytes")
        except (OSError, ValueError) as exc:
            self.dropped += 1
            if self.dropped == 1 or self._recovered:
                log.warning("--record: a record was dropped (%s); requests go on unrecorded while writes fail", exc)
            self._recovered = False
            return
        self._recovered = True

    _recovered = False

    def open_files(self) -> int:
        with self._lock:
            return len(self._fds)

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
