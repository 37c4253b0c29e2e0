"""`/metrics` stays honest under memory pressure: with a KV pool too small for the concurrent requests, sequences are
preempted and re-admitted, and the prefix-cache queries and hits still equal an independent count taken from the
responses (re-admissions are counted apart, as vLLM does), never inflated by them."""
from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from engine.config import EngineConfig
from server.pipeline.context import ServerSettings, load_context
from tests.server.conftest import LiveServer, serve


@pytest.fixture(scope="module")
def tight_server() -> Iterator[LiveServer]:
    # 48 blocks of 4 tokens: one request fits easily, eight at once do not.
    ctx = load_context("qwen3-tiny", EngineConfig(block_size=4, num_kv_blocks=48, max_num_seqs=16, max_model_len=256),
                       ServerSettings())
    with serve(ctx) as url:
        yield LiveServer(ctx, url)


def test_queries_and_hits_match_the_responses_under_preemption(tight_server: LiveServer) -> None:
    server = tight_server
    before = server.metrics()

    async def ask(i: int):
        client = server.async_client()
        try:
            return await client.chat.completions.create(
                model=server.ctx.model_name, max_tokens=24, temperature=0, extra_body={"ignore_eos": True},
                messages=[{"role": "user", "content": f"Request {i}: list {i + 3} prime numbers and explain."}])
        finally:
            await client.close()

    async def ask_all():
        return await asyncio.gather(*(ask(i) for i in range(8)))

    replies = asyncio.run(ask_all())
    after = server.metrics()
    label = f'{{model="{server.ctx.model_name}"}}'

    def delta(name: str) -> float:
        return after[f"kvserve_{name}{label}"] - before.get(f"kvserve_{name}{label}", 0.0)

    assert delta("preemptions_total") > 0  # the pool really was too small
    assert delta("prefix_cache_preempted_queries_tokens_total") > 0
    assert delta("prefix_cache_queries_tokens_total") == sum(r.usage.prompt_tokens for r in replies)
    assert delta("prefix_cache_hits_tokens_total") == sum(r.usage.prompt_tokens_details.cached_tokens for r in replies)
    assert all(r.usage.completion_tokens == 24 for r in replies)
    server.wait_until_idle()
