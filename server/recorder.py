"""`kvserve serve --record FILE.jsonl`: one JSON line per finished request, for replay by the prefix-cache benchmark
(`kvserve bench replay|simulate --trace FILE.jsonl`, see benchmarks/prefix/replay.py).

Each line: `body` (the request as the client sent it), `prompt_token_ids` (exactly what the engine prefilled),
`output_token_ids` (choice 0), `cached_tokens`, `cache_salt` (the effective salt: a tenant hash, never an API key),
`session` (the agent session the client named: `prompt_cache_key`, Claude Code's session id; see server/session.py),
`timings` (seconds), plus `request_id`, `endpoint`, `model`, `finish_reason` and `time` (unix seconds). A batched
text completion writes one line per prompt.
"""
from __future__ import annotations

import json
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

from engine.request import RequestTimings


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


def timing_fields(timings: RequestTimings | None) -> dict[str, float | None]:
    if timings is None:
        return {}
    return {"queue_s": timings.queue_s, "ttft_s": timings.ttft_s, "e2e_s": timings.e2e_s}


class Recorder:
    """Appends records to a JSONL file; one line per write, flushed, so a crash loses at most the line in flight."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: TextIO = self.path.open("a", encoding="utf-8")
        self._lock = threading.Lock()

    def write(self, record: RequestRecord) -> None:
        line = json.dumps(asdict(record), ensure_ascii=False) + "\n"
        with self._lock:
            self._file.write(line)
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()
