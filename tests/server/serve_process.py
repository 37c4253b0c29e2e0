"""`kvserve serve` as a user runs it, in a subprocess: its stderr read line by line, its URL from the banner."""
from __future__ import annotations

import queue
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import httpx


@dataclass
class ServeProcess:
    proc: subprocess.Popen
    lines: queue.Queue
    output: list[str] = field(default_factory=list)
    url: str = ""

    def read_until(self, pattern: str, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while True:
            line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            assert line is not None, "the server exited:\n" + "".join(self.output)
            self.output.append(line)
            if found := re.search(pattern, line):
                return found

    def unhealthy_then_exit(self, since: float) -> str:
        """/health answers 503, then the server exits with status 1, within seconds of ``since``; returns its
        output."""
        statuses = set()
        while time.monotonic() - since < 10:
            try:
                statuses.add(httpx.get(f"{self.url}/health", timeout=2).status_code)
            except httpx.TransportError:  # exiting: no longer listening
                break
            time.sleep(0.02)
        assert 503 in statuses, statuses
        assert self.proc.wait(timeout=20) == 1
        assert time.monotonic() - since < 20
        return self.rest_of_output()

    def rest_of_output(self) -> str:
        while (line := self.lines.get(timeout=30)) is not None:
            self.output.append(line)
        return "".join(self.output)


@contextmanager
def serve_cli(*args: str, timeout: float = 180) -> Iterator[ServeProcess]:
    """`kvserve serve` with ``args`` on a free port (warnings only), from its banner on; killed on exit if it still
    runs."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "server.cli", "serve", "--port", "0", "--log-level", "warning", *args],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr] + [lines.put(None)], daemon=True).start()
    server = ServeProcess(proc, lines)
    try:
        server.url = server.read_until(r"serving \S+ at (http://127\.0\.0\.1:\d+)/v1", timeout).group(1)
        yield server
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def serve_qwen3_tiny(*flags: str):
    """`serve_cli` on qwen3-tiny (4-token blocks, a 512-token context) with ``flags``."""
    return serve_cli("--model", "qwen3-tiny", "--block-size", "4", "--max-model-len", "512", *flags)
