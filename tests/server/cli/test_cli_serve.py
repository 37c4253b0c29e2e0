"""`kvserve serve` as a user runs it: a subprocess that says what it serves and where, answers, records, and on
SIGTERM lets the running stream finish before it exits cleanly."""
from __future__ import annotations

import json
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from server.cli import build_parser


def test_serve_help_lists_the_options() -> None:
    parser = build_parser()
    serve = parser._subparsers._group_actions[0].choices["serve"]  # noqa: SLF001 - argparse has no public getter
    text = serve.format_help()
    for flag in ("--model", "--host", "--port", "--api-key", "--block-size", "--num-kv-blocks", "--max-num-seqs",
                 "--max-num-batched-tokens", "--no-prefix-cache", "--device", "--dtype", "--record",
                 "--allow-request-cache-salt", "--strict-max-tokens", "--engine-process", "--engine-process-timeout"):
        assert flag in text, flag
    assert "smollm2-135m" in text and "curl" in text


def _lines(stream, sink: queue.Queue) -> None:
    for line in stream:
        sink.put(line)
    sink.put(None)


@pytest.mark.slow
def test_serve_subprocess_banner_request_record_and_graceful_sigterm(tmp_path: Path) -> None:
    record = tmp_path / "trace.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "server.cli", "serve", "--model", "qwen3-tiny", "--port", "0", "--block-size", "4",
         "--num-kv-blocks", "256", "--max-model-len", "256", "--api-key", "sk-cli", "--record", str(record),
         "--log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_lines, args=(proc.stderr, lines), daemon=True).start()
    output: list[str] = []
    try:
        url = None
        deadline = time.monotonic() + 120
        while url is None:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            assert line is not None, "".join(output)
            output.append(line)
            found = re.search(r"serving qwen3-tiny at (http://127\.0\.0\.1:\d+/v1)", line)
            url = found and found.group(1)
        assert any("loading" in line for line in output) and any("loaded qwen3-tiny" in line for line in output)
        # 256 pages x 4 tokens; K and V of 2 layers x 2 KV heads x 16 dims in fp32
        assert any("1,024 tokens fit (gqa cache, 512 KV bytes per token)" in line for line in output), output

        headers = {"Authorization": "Bearer sk-cli"}
        body = {"model": "qwen3-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 24,
                "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{url}/chat/completions", json=body, headers=headers, timeout=60) as response:
            frames = response.iter_lines()
            first = next(line for line in frames if line)
            assert first.startswith("data: ")
            proc.send_signal(signal.SIGTERM)  # mid-stream: the stream must still complete
            rest = [line for line in frames if line]
        assert rest[-1] == "data: [DONE]"
        finish = json.loads(rest[-2][len("data: "):])["choices"][0]["finish_reason"]
        assert finish == "length"

        assert proc.wait(timeout=60) == 0
        while (line := lines.get(timeout=10)) is not None:
            output.append(line)
        # (not necessarily the last line: Triton's bindings may report leaks as the interpreter exits)
        assert any("stopped" in line for line in output), output[-5:]
        [row] = [json.loads(line) for line in record.read_text().splitlines()]
        assert row["endpoint"] == "chat" and len(row["output_token_ids"]) == 24 and row["body"]["max_tokens"] == 24
        assert row["cache_salt"] and "sk-cli" not in json.dumps(row)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
