"""The engine core in a process of its own (`--engine-process on`): the same greedy tokens as the thread core,
streamed and not, n > 1; a client that disconnects frees its blocks; named caches, count_tokens, /tokenize and the
inspector answer over the process boundary; a killed core process turns /health into 503 and ends the server."""
from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager

import httpx
import pytest

from engine.config import EngineConfig
from server.pipeline.context import ServerSettings
from tests.server.conftest import KEY_A, KEY_B, LiveServer, _live_server
from tests.server.serve_process import ServeProcess, serve_qwen3_tiny

MESSAGES = [{"role": "system", "content": "You are a careful coding agent."},
            {"role": "user", "content": "List the files of the repository, then explain the cache."}]


@pytest.fixture(scope="module")
def process_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """The `qwen_server` fixture's engine and tenants, its core in a process of its own, with the inspector. A server
    that stops stops its core cleanly: no engine error (`kvserve serve` would exit 1), the core's exit code 0."""
    servers = _live_server(
        tmp_path_factory, "qwen3-tiny", EngineConfig(block_size=4, num_kv_blocks=2048, max_num_seqs=64,
                                                     max_model_len=512),
        ServerSettings(api_keys=(KEY_A, KEY_B), max_n=4, ui=True), api_key=KEY_A, engine_process=True)
    server = next(servers)
    yield server
    next(servers, None)
    core = server.ctx.engine.core
    assert server.ctx.engine.error is None and core.exitcode == 0, (server.ctx.engine.error, core.exitcode)


def _texts(server: LiveServer, stream: bool) -> list[str]:
    kwargs = dict(messages=MESSAGES, max_tokens=8, temperature=0, n=2, logprobs=True, top_logprobs=2)
    if not stream:
        return [c.message.content for c in server.chat(**kwargs).choices]
    texts = ["", ""]
    for chunk in server.chat(stream=True, **kwargs):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    return texts


def test_the_process_core_gives_the_thread_cores_greedy_tokens(process_server: LiveServer,
                                                               qwen_server: LiveServer) -> None:
    expected = _texts(qwen_server, stream=False)
    assert expected[0] and expected[0] == expected[1]
    assert _texts(process_server, stream=False) == expected
    assert _texts(process_server, stream=True) == expected
    completion = dict(model="qwen3-tiny", prompt=[[5, 900, 77, 12, 4000, 31, 8]], max_tokens=6, temperature=0)
    assert (process_server.client().completions.create(**completion).choices[0].text ==
            qwen_server.client().completions.create(**completion).choices[0].text)


@pytest.mark.slow
@pytest.mark.slow
def test_a_grammar_constrains_the_process_cores_output_as_the_thread_cores(process_server: LiveServer,
                                                                            qwen_server: LiveServer) -> None:
    """The server compiles it in its compile workers and sends it with the request; the core process reads it."""
    constrained = dict(messages=MESSAGES, max_tokens=12, temperature=0, response_format={"type": "json_object"})
    json_text = process_server.chat(**constrained).choices[0].message.content
    assert json_text.strip().startswith("{") and json_text == qwen_server.chat(**constrained).choices[0].message.content


@pytest.mark.slow
@pytest.mark.slow
def test_a_client_that_disconnects_frees_its_blocks(process_server: LiveServer) -> None:
    core = process_server.ctx.engine.core
    with process_server.http() as http:
        with http.stream("POST", "/v1/chat/completions", json={
                "model": "qwen3-tiny", "messages": MESSAGES, "max_tokens": 400, "ignore_eos": True,
                "temperature": 0, "stream": True}) as response:
            chunks = response.iter_lines()
            assert next(chunks).startswith("data: ")
            assert core.stats().result(30).requests_running == 1
    deadline = time.monotonic() + 30
    while (stats := core.stats().result(30)).requests_running or stats.kv_blocks_free < stats.kv_blocks_total:
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)
    assert process_server.metric("kvserve_requests_running") == 0


@pytest.mark.slow
@pytest.mark.slow
def test_caches_tokens_and_the_inspector_over_the_process_boundary(process_server: LiveServer) -> None:
    with process_server.http() as http:
        created = http.post("/v1/caches", json={"name": "map", "model": "qwen3-tiny", "messages": MESSAGES,
                                                "ttl": "1h"})
        assert created.status_code == 200, created.text
        tokens = created.json()["tokens"]
        assert http.get("/v1/caches/map").json()["cached_tokens"] == tokens // 4 * 4
        assert process_server.ctx.engine.core.stats().result(30).kv_blocks_retained >= tokens // 4
        tokenized = http.post("/tokenize", json={"model": "qwen3-tiny", "messages": MESSAGES}).json()
        assert tokenized["cached_tokens"] >= tokens // 4 * 4 - 4
        assert http.delete("/v1/caches/map").json()["deleted"]
        assert process_server.ctx.engine.core.stats().result(30).kv_blocks_retained == 0
        reply = process_server.chat(messages=MESSAGES, max_tokens=4, temperature=0, prompt_cache_key="s-proc")
        view = http.get(f"/ui/api/requests/{reply.id}")
        assert view.status_code == 200, view.text
        blocks = view.json()["blocks_now"]
        assert len(blocks) == len(view.json()["token_ids"]) // 4 and set(blocks) <= {"device", "retained"}
        cache = http.get("/ui/api/cache").json()
        assert cache["largest_prefixes"] and cache["largest_prefixes"][0]["tokens"] >= tokens // 4 * 4
    counted = process_server.anthropic().messages.count_tokens(model="qwen3-tiny", messages=MESSAGES[1:])
    assert counted.input_tokens > 10


def _serve(*flags: str) -> AbstractContextManager[ServeProcess]:
    """`kvserve serve --engine-process on` as a user runs it, on qwen3-tiny, until its banner."""
    return serve_qwen3_tiny("--num-kv-blocks", "256", "--engine-process", "on", *flags)


def _unhealthy_then_exit(server: ServeProcess, since: float) -> None:
    """/health answers 503, then the server exits with status 1 and says the engine died."""
    assert "stopped: the engine died" in server.unhealthy_then_exit(since)


@pytest.mark.slow
@pytest.mark.slow
def test_a_killed_core_process_fails_health_and_ends_the_server() -> None:
    with _serve() as server:
        core_pid = int(re.search(r"the engine core runs in process (\d+)", "".join(server.output)).group(1))
        assert core_pid != server.proc.pid and httpx.get(f"{server.url}/health", timeout=10).status_code == 200
        os.kill(core_pid, signal.SIGKILL)
        _unhealthy_then_exit(server, time.monotonic())
        assert f"the engine core process (pid {core_pid}) was killed by SIGKILL" in "".join(server.output)


@pytest.mark.slow
@pytest.mark.slow
def test_a_killed_tensor_parallel_worker_of_the_core_process_ends_the_server() -> None:
    """The core process is rank 0: a worker's death ends its engine, and so the server, as in-process."""
    with _serve("--tensor-parallel-size", "2") as server:
        worker_pid = int(re.search(r"tensor parallel rank 1 \(cpu, pid (\d+)\)", "".join(server.output)).group(1))
        body = {"model": "qwen3-tiny", "messages": MESSAGES, "max_tokens": 400, "temperature": 0, "stream": True,
                "ignore_eos": True}
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as response:
            frames = (line for line in response.iter_lines() if line)
            assert next(frames).startswith("data: ")
            killed = time.monotonic()
            os.kill(worker_pid, signal.SIGKILL)
            rest = list(frames)
        assert '"error"' in rest[-2] and "killed by SIGKILL" in rest[-2] and rest[-1] == "data: [DONE]", rest[-3:]
        _unhealthy_then_exit(server, killed)


@pytest.mark.slow
@pytest.mark.slow
def test_a_core_that_cannot_start_says_why(tmp_path) -> None:
    from engine.core.process import CoreProcess, CoreStartError

    with pytest.raises(CoreStartError, match=r"could not build the engine:\n(.|\n)*config\.json"):
        CoreProcess(tmp_path, EngineConfig(device="cpu"))  # no model there
    with pytest.raises(CoreStartError, match=r"did not start within 0\.5s \(raise --engine-process-timeout"):
        CoreProcess(tmp_path, EngineConfig(device="cpu"), startup_timeout_s=0.5)
