"""32 concurrent streaming clients, a quarter of them hanging up midway: the others complete, the engine batches
them, and afterwards no sequence is live and every KV page is free or cached."""
from __future__ import annotations

import asyncio
import time

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


def test_concurrent_streams_with_disconnects_leak_no_pages(qwen_server: LiveServer) -> None:
    aborted_before = qwen_server.metrics().get(
        'kvserve_requests_finished_total{model="qwen3-tiny",finish_reason="abort"}', 0.0)
    results, most_running = asyncio.run(_run_all(qwen_server))

    completed = [r for r in results if not r["quit"]]
    assert len(completed) == CLIENTS - CLIENTS // 4
    for result in completed:
        assert result["finish"] == "length" and result["text"]
        assert result["usage"].completion_tokens == COMPLETE_TOKENS
    assert most_running > 1, "concurrent requests are batched into the same steps"

    # Every quitter asked for 400 tokens; they are gone long before that many steps could have run.
    qwen_server.wait_until_idle(timeout=20)
    total, free, live = qwen_server.in_engine(lambda e: (e.kv.num_pages, e.kv.num_free_pages, len(e.kv.seqs)))
    assert live == 0 and free == total, "every page is free or cached-and-evictable"
    qwen_server.in_engine(lambda e: e.kv.check_invariants())
    assert qwen_server.metric("kvserve_kv_pages_free") == total
    assert qwen_server.metric("kvserve_requests_running") == 0
    assert qwen_server.metric("kvserve_requests_waiting") == 0
    aborted = qwen_server.metrics()['kvserve_requests_finished_total{model="qwen3-tiny",finish_reason="abort"}']
    assert aborted - aborted_before == CLIENTS // 4

    # And the server keeps serving.
    assert qwen_server.chat(messages=[{"role": "user", "content": "still there?"}], max_tokens=2).choices


def test_idle_engine_thread_blocks_instead_of_spinning(qwen_server: LiveServer) -> None:
    qwen_server.wait_until_idle()
    start = time.process_time()  # CPU time of every thread of this process, the server's included
    time.sleep(1.0)
    assert time.process_time() - start < 0.25, "an idle server burns CPU"
