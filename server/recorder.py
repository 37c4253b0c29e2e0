"""`kvserve serve --record FILE.jsonl`: one JSON line per finished request, for replay by the prefix-cache benchmark
(`kvserve bench replay|simulate --trace FILE.jsonl`, see benchmarks/prefix/replay.py).

Each line: `body` (the request as the client sent it), `prompt_token_ids` (exactly what the engine prefilled),
`output_token_ids` (choice 0), `cached_tokens`, `cache_salt` (the effective salt: a tenant hash, never an API key),
`session` (the agent session the client named: `prompt_cache_key`, Claude Code's session id; see server/session.py),
`timings` (seconds), `speculation` (speculative decoding's counters for choice 0: drafts, accepted, acceptance rate,
mean accepted length, tokens per step; null when it did not speculate), plus `request_id`, `endpoint`, `model`, `finish_reason` and `time` (unix seconds). A batched
text completion writes one line per prompt.

A path with `{salt}` writes one file per cache salt (a tenant, or an end user behind a request `cache_salt`): the
placeholder becomes a hash of the salt (`shared` without one), so that each tenant's traffic can be handed to it
alone. Files are created readable by their owner only (they hold prompts).
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

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


class Recorder:
    """Appends records to a JSONL file (one per cache salt when the path has `{salt}`); one line per write, flushed,
    so a crash loses at most the line in flight."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._files: dict[Path, TextIO] = {}
        self._lock = threading.Lock()
        if SALT_PLACEHOLDER not in str(path):
            self._file_for(None)  # created at once, so a bad path fails at start-up

    def _file_for(self, salt: str | None) -> TextIO:
        path = self.path
        if SALT_PLACEHOLDER in str(path):
            name = "shared" if salt is None else hashlib.sha256(salt.encode()).hexdigest()[:16]
            path = Path(str(path).replace(SALT_PLACEHOLDER, name))
        file = self._files.get(path)
        if file is None:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            file = self._files[path] = os.fdopen(fd, "a", encoding="utf-8")
        return file

    def write(self, record: RequestRecord) -> None:
        line = json.dumps(asdict(record), ensure_ascii=False) + "\n"
        with self._lock:
            file = self._file_for(record.cache_salt)
            file.write(line)
            file.flush()

    def close(self) -> None:
        with self._lock:
            for file in self._files.values():
                file.close()
            self._files.clear()
