"""`kvserve serve --tensor-parallel-size 2` as a user runs it (CPU, gloo): the banner shows what each rank holds,
chat works end to end with the single-process server's exact answers, and killing a worker mid-request turns
/health to 503 and makes the server exit with status 1 and the worker's fate within seconds."""
from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.server.conftest import LiveServer
from tests.server.serve_process import ServeProcess, serve_qwen3_tiny

MESSAGES = [{"role": "user", "content": "Name three prime numbers and explain why they are prime."}]


@pytest.fixture(scope="module")
def tp_server() -> Iterator[ServeProcess]:
    with serve_qwen3_tiny("--tensor-parallel-size", "2", "--num-kv-blocks", "2048", "--shutdown-timeout", "5") as server:
        yield server


@pytest.mark.slow  # starts a core process and its rank (~15 s)
def test_banner_shows_what_each_rank_holds(tp_server: ServeProcess):
    ranks = [re.search(r"tensor parallel rank (\d) \(cpu, pid (\d+)\): weights ([\d.]+) MiB \(([\d.]+) sharded",
                       line) for line in tp_server.output]
    ranks = [r for r in ranks if r]
    assert [r.group(1) for r in ranks] == ["0", "1"]
    # rank 0 is the engine core's process (the server's child, `--engine-process on` by default), rank 1 its own
    assert str(tp_server.proc.pid) not in (ranks[0].group(2), ranks[1].group(2))
    assert ranks[1].group(2) != ranks[0].group(2)
    assert ranks[0].group(3) == ranks[1].group(3)  # the same share each
    # qwen3-tiny holds 37.4 MiB of weights, nearly all in split layers: each rank half of it
    assert 18.0 < float(ranks[0].group(4)) < 19.0


@pytest.mark.slow
def test_chat_end_to_end_matches_the_single_process_server(tp_server: ServeProcess, qwen_server: LiveServer):
    client = openai.OpenAI(base_url=f"{tp_server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    kwargs = dict(messages=MESSAGES, max_tokens=24, temperature=0)
    parallel = client.chat.completions.create(model="qwen3-tiny", **kwargs)
    single = qwen_server.chat(**kwargs)
    assert parallel.choices[0].message.content == single.choices[0].message.content
    assert parallel.usage.completion_tokens == 24
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in
                       client.chat.completions.create(model="qwen3-tiny", **kwargs, stream=True) if chunk.choices)
    assert streamed == parallel.choices[0].message.content
    assert httpx.get(f"{tp_server.url}/health", timeout=10).status_code == 200


@pytest.mark.slow
def test_killing_a_worker_mid_request_makes_the_server_unhealthy_and_exit(tp_server: ServeProcess):
    worker_pid = int(re.search(r"tensor parallel rank 1 \(cpu, pid (\d+)\)", "".join(tp_server.output)).group(1))
    body = {"model": "qwen3-tiny", "messages": MESSAGES, "max_tokens": 400, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{tp_server.url}/v1/chat/completions", json=body, timeout=60) as response:
        frames = (line for line in response.iter_lines() if line)
        assert next(frames).startswith("data: ")
        killed = time.monotonic()
        subprocess.run(["kill", "-9", str(worker_pid)], check=True)
        rest = list(frames)
    # the stream ends with an error event that says what happened, not with a finish reason
    assert '"error"' in rest[-2] and "killed by SIGKILL" in rest[-2] and rest[-1] == "data: [DONE]", rest[-3:]
    assert not any('"finish_reason":"' in frame for frame in rest)
    output = tp_server.unhealthy_then_exit(killed)
    assert re.search(rf"worker rank 1 \(pid {worker_pid}\) was killed by SIGKILL", output), output[-3000:]
    assert "stopped: the engine died" in output
