"""32 concurrent streaming clients, a quarter of them hanging up midway: the others complete, the engine batches
them, and afterwards no sequence is live and every KV page is free or cached."""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.server.conftest import LiveServer

CLIENTS = 32
COMPLETE_TOKENS = 8
# Clients that hang up ask for many tokens: only an abort (not finishing) can free their pages in time.
QUITTER_TOKENS = 400


async def _client(server: LiveServer, i: int, quitter: bool) -> dict:
    client = server.async_client()
    try:
        stream = await client.chat.completions.create(
            model=server.ctx.model_name,
            messages=[{"role": "user", "content": f"Client {i}: tell me a story."}],
            max_tokens=QUITTER_TOKENS if quitter else COMPLETE_TOKENS, seed=i, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
        text, finish, usage, chunks = "", None, None, 0
        async for chunk in stream:
            chunks += 1
            if quitter and chunks == 3:
                await stream.close()  # hang up mid-generation
                return {"quit": True}
            for choice in chunk.choices:
                text += choice.delta.content or ""
                finish = choice.finish_reason or finish
            usage = chunk.usage or usage
        return {"quit": False, "text": text, "finish": finish, "usage": usage}
    finally:
        await client.close()


async def _max_running(server: LiveServer, done: asyncio.Event) -> int:
    most = 0
    while not done.is_set():
        running = await asyncio.to_thread(server.metric, "kvserve_requests_running")
        most = max(most, int(running))
        await asyncio.sleep(0.05)
    return most


async def _run_all(server: LiveServer) -> tuple[list[dict], int]:
    done = asyncio.Event()
    watcher = asyncio.create_task(_max_running(server, done))
    results = await asyncio.gather(*(_client(server, i, quitter=i % 4 == 0) for i in range(CLIENTS)))
    done.set()
    return results, await watcher


ABORTED = 'kvserve_requests_finished_total{model="qwen3-tiny",finish_reason="abort"}'
GENERATED = 'kvserve_generation_tokens_total{model="qwen3-tiny"}'


@pytest.mark.slow
def test_concurrent_streams_with_disconnects_leak_no_pages(qwen_server: LiveServer) -> None:
    before = qwen_server.metrics()
    results, most_running = asyncio.run(_run_all(qwen_server))

    completed = [r for r in results if not r["quit"]]
    assert len(completed) == CLIENTS - CLIENTS // 4
    for result in completed:
        assert result["finish"] == "length" and result["text"]
        assert result["usage"].completion_tokens == COMPLETE_TOKENS
    assert most_running > 1, "concurrent requests are batched into the same steps"

    qwen_server.wait_until_idle(timeout=20)
    stats = qwen_server.stats()
    total = stats.kv_blocks_total
    assert stats.kv_blocks_free == total, "every block is free or cached-and-evictable"
    qwen_server.in_engine(lambda e: e.scheduler.kv.check_invariants())  # the KV manager's own audit (no public view)
    assert qwen_server.metric("kvserve_kv_blocks_free") == total
    assert qwen_server.metric("kvserve_requests_running") == 0
    assert qwen_server.metric("kvserve_requests_waiting") == 0
    after = qwen_server.metrics()
    assert after[ABORTED] - before.get(ABORTED, 0.0) == CLIENTS // 4
    # The quitters were stopped early: nowhere near their 400 tokens each were generated.
    quitters = CLIENTS // 4
    assert after[GENERATED] - before[GENERATED] < len(completed) * COMPLETE_TOKENS + quitters * QUITTER_TOKENS / 2

    # And the server keeps serving.
    assert qwen_server.chat(messages=[{"role": "user", "content": "still there?"}], max_tokens=2).choices


def test_idle_engine_thread_blocks_instead_of_spinning(qwen_server: LiveServer) -> None:
    qwen_server.wait_until_idle()
    start = time.process_time()  # CPU time of every thread of this process, the server's included
    time.sleep(1.0)
    assert time.process_time() - start < 0.25, "an idle server burns CPU"


def test_non_streaming_client_that_gives_up_aborts_its_request(qwen_server: LiveServer) -> None:
    body = {"model": "qwen3-tiny", "messages": [{"role": "user", "content": "a long answer please"}],
            "max_tokens": 400, "ignore_eos": True}
    before = qwen_server.metrics()
    with pytest.raises(httpx.ReadTimeout), qwen_server.http() as http:
        http.post("/v1/chat/completions", json=body, timeout=httpx.Timeout(60, read=0.5))
    # Hanging up closes the connection; the server notices and aborts the request, freeing its pages.
    qwen_server.wait_until_idle(timeout=20)
    stats = qwen_server.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total
    after = qwen_server.metrics()
    assert after[ABORTED] - before.get(ABORTED, 0.0) == 1
    assert after[GENERATED] - before[GENERATED] < 400
