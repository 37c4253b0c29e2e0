"""Endings: a stream still running when the shutdown's grace period ends gets its API's error event (it was cut off
with no closing event); SIGTERM finishes within its timeout whatever is compiling; an offline script with
tensor-parallel workers that never closes its `LLM` still exits."""
from __future__ import annotations

import gc
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from pathlib import Path

import httpx
import pytest

from engine.config import EngineConfig
from server.http.app import create_app
from server.pipeline.context import ServerSettings, load_context
from server.http.graceful import GracefulServer
from tests.server.conftest import serve

LONG_STREAM = {"model": "qwen3-tiny", "messages": [{"role": "user", "content": "count"}], "max_tokens": 100_000,
               "temperature": 0, "ignore_eos": True, "stream": True}


def _stream_events(url: str, path: str, body: dict, events: list, started: threading.Event,
                   headers: dict | None = None) -> None:
    with httpx.stream("POST", f"{url}{path}", json=body, headers=headers, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                started.set()


def test_a_stream_cut_by_shutdown_ends_with_the_apis_error_event() -> None:
    ctx = load_context("qwen3-tiny", EngineConfig(block_size=4, num_kv_blocks=4096, max_model_len=16_384),
                       ServerSettings())
    sock = socket.create_server(("127.0.0.1", 0))
    server = GracefulServer(create_app(ctx), log_level="warning", timeout_graceful_shutdown=2)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive()
        time.sleep(0.02)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    streams = {"chat": ("/v1/chat/completions", LONG_STREAM),
               "messages": ("/v1/messages", {**LONG_STREAM, "max_tokens": 16_000})}
    events: dict[str, list[str]] = {name: [] for name in streams}
    started = {name: threading.Event() for name in streams}
    clients = [threading.Thread(target=_stream_events, args=(url, path, body, events[name], started[name]),
                                daemon=True) for name, (path, body) in streams.items()]
    for client in clients:
        client.start()
    for name in streams:
        assert started[name].wait(60), name
    stopping = time.monotonic()
    server.should_exit = True
    thread.join(30)
    took = time.monotonic() - stopping
    for client in clients:
        client.join(10)
    assert not thread.is_alive() and took < 2 + 5, took
    chat = events["chat"]
    assert chat[-1] == "[DONE]" and json.loads(chat[-2])["error"]["code"] == "server_shutting_down", chat[-3:]
    last = json.loads(events["messages"][-1])
    assert last["type"] == "error" and "shutting down" in last["error"]["message"], last


@pytest.mark.slow  # loads and drops a model twice (~8 s)
def test_a_stopped_server_lets_go_of_its_model() -> None:
    """FastAPI keeps every endpoint function for the process's life: a handler that closed over the served context
    would keep each stopped server's model, KV cache and tokenizers alive (a process that starts many servers, as
    this suite does, grew by ~400 MB per server). Every route is registered (the inspector's too) and called."""
    ctx = load_context("qwen3-tiny", EngineConfig(block_size=4, num_kv_blocks=256, max_model_len=256),
                       ServerSettings(ui=True))
    with serve(ctx) as url:
        reply = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "model": "qwen3-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert reply.status_code == 200, reply.text
        for path in ("/v1/caches", "/get_load", "/ui/api/sessions", "/health", "/metrics"):
            assert httpx.get(f"{url}{path}", timeout=60).status_code == 200, path
    served, model = weakref.ref(ctx), weakref.ref(ctx.engine.core)
    del ctx
    gc.collect()
    assert served() is None and model() is None, gc.get_referrers(served() or model())


def _serve_subprocess(*flags: str) -> tuple[subprocess.Popen, str, queue.Queue]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "server.cli", "serve", "--model", "qwen3-tiny", "--port", "0", "--block-size", "4",
         "--num-kv-blocks", "4096", "--max-model-len", "16384", "--log-level", "warning", *flags],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr], daemon=True).start()
    deadline = time.monotonic() + 180
    while True:
        line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        found = re.search(r"serving qwen3-tiny at (http://127\.0\.0\.1:\d+)/v1", line)
        if found:
            return proc, found.group(1), lines


@pytest.mark.slow
@pytest.mark.slow
def test_sigterm_finishes_within_its_timeout_whatever_is_compiling() -> None:
    """A grammar compiling for minutes (an enum of 100,000 strings, the limits raised out of its way) held SIGTERM
    until it was done; a running stream was cut off with no closing event."""
    proc, url, _ = _serve_subprocess("--shutdown-timeout", "3", "--max-enum-values", "1000000",
                                     "--max-schema-bytes", "100000000", "--max-request-bytes", "100000000",
                                     "--grammar-compile-timeout", "3600")
    try:
        warm = httpx.post(f"{url}/v1/chat/completions", timeout=300, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "response_format": {"type": "json_object"}})
        assert warm.status_code == 200, warm.text  # the compile worker is up
        events: list[str] = []
        started = threading.Event()
        stream = threading.Thread(target=_stream_events, args=(url, "/v1/chat/completions", LONG_STREAM, events,
                                                               started), daemon=True)
        stream.start()
        assert started.wait(60)
        enum = {"type": "string", "enum": [f"value number {i}" for i in range(100_000)]}
        compiling: list[httpx.Response] = []
        hostile = threading.Thread(target=lambda: compiling.append(httpx.post(
            f"{url}/v1/chat/completions", timeout=300, json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                "response_format": {"type": "json_schema", "json_schema": {"name": "e", "schema": enum}}})),
            daemon=True)
        hostile.start()
        time.sleep(3)  # it is compiling now
        stopping = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
        took = time.monotonic() - stopping
        stream.join(10)
        hostile.join(10)
        assert code == 0 and took < 3 + 10, (code, took)
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "server_shutting_down"
        assert compiling and compiling[0].status_code == 503, compiling
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
@pytest.mark.slow
def test_an_offline_script_with_tensor_parallel_workers_exits_without_closing(tmp_path) -> None:
    """`LLM(..., tensor_parallel_size=2)`: the script printed its results, then its interpreter waited forever for a
    worker that ignores SIGTERM."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent("""
        from engine import LLM, SamplingParams

        if __name__ == "__main__":  # the workers are spawned
            llm = LLM("qwen3-tiny", tensor_parallel_size=2, block_size=4, num_kv_blocks=64)
            out = llm.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
            print("tokens", out[0].token_ids, flush=True)  # and no llm.close()
    """))
    root = str(Path(__file__).resolve().parents[3])  # this checkout's engine, not an installed one
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180,
                            env={**os.environ, "PYTHONPATH": root})
    assert result.returncode == 0 and "tokens" in result.stdout, result.stderr[-2000:]
