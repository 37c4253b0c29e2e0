"""The prefix cache seen from the API: a conversation's second turn reuses the first turn's pages, `/metrics` moves
with it, tenants (API keys, request salts) never share pages, and `--record` writes what the benchmark replays."""
from __future__ import annotations

import json
import uuid
from dataclasses import replace

import openai
import pytest

from tests.server.conftest import KEY_B, LiveServer


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _last_record(server: LiveServer) -> dict:
    assert server.record_path is not None
    return json.loads(server.record_path.read_text().splitlines()[-1])


def _first_turn() -> list[dict]:
    # A fresh system prompt per test: nothing of it can be cached yet.
    return [{"role": "system", "content": f"Session {uuid.uuid4()}."},
            {"role": "user", "content": "Name three rivers."}]


def test_second_turn_hits_the_block_aligned_shared_prefix_and_metrics_move(qwen_server: LiveServer) -> None:
    bs = qwen_server.ctx.engine.facts.block_size
    turn1 = _first_turn()
    first = qwen_server.chat(messages=turn1, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    record = _last_record(qwen_server)
    assert record["request_id"] == first.id and record["cached_tokens"] == 0
    assert len(record["prompt_token_ids"]) == first.usage.prompt_tokens and len(record["output_token_ids"]) == 8

    turn2 = turn1 + [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "And three mountains?"}]
    with qwen_server.http() as http:
        tokenized = http.post("/tokenize", json={"messages": turn2}).json()
    prompt2 = tokenized["tokens"]
    # What the first turn left in the cache: its prompt and its output but the last sampled token (never fed back).
    context1 = record["prompt_token_ids"] + record["output_token_ids"][:-1]
    expected = min(_common_prefix(prompt2, context1), len(prompt2) - 1) // bs * bs
    assert expected >= len(record["prompt_token_ids"]) - bs, "the whole first prompt is shared"
    assert tokenized["cached_tokens"] == expected

    queries, hits = qwen_server.metric("kvserve_prefix_cache_queries_tokens_total"), \
        qwen_server.metric("kvserve_prefix_cache_hits_tokens_total")
    second = qwen_server.chat(messages=turn2, max_tokens=2)
    assert second.usage.prompt_tokens == len(prompt2)
    assert second.usage.prompt_tokens_details.cached_tokens == expected
    assert qwen_server.metric("kvserve_prefix_cache_queries_tokens_total") - queries == len(prompt2)
    assert qwen_server.metric("kvserve_prefix_cache_hits_tokens_total") - hits == expected
    assert _last_record(qwen_server)["cached_tokens"] == expected


def test_tenants_never_share_pages(qwen_server: LiveServer) -> None:
    turn = _first_turn()
    qwen_server.chat(messages=turn, max_tokens=1)
    warm = qwen_server.chat(messages=turn, max_tokens=1).usage.prompt_tokens_details.cached_tokens
    assert warm > 0
    other_tenant = qwen_server.chat(api_key=KEY_B, messages=turn, max_tokens=1)
    assert other_tenant.usage.prompt_tokens_details.cached_tokens == 0
    assert _last_record(qwen_server)["cache_salt"] not in (None, KEY_B), "the record holds a hash, not the key"


def test_request_cache_salt_only_when_the_operator_allows_it(
    qwen_server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    turn = _first_turn()
    with pytest.raises(openai.BadRequestError) as err:
        qwen_server.chat(messages=turn, max_tokens=1, extra_body={"cache_salt": "user-1"})
    assert err.value.body["param"] == "cache_salt" and err.value.body["code"] == "cache_salt_not_allowed"

    ctx = qwen_server.ctx
    monkeypatch.setattr(ctx, "settings", replace(ctx.settings, allow_request_cache_salt=True))
    qwen_server.chat(messages=turn, max_tokens=1)  # the tenant's own pages
    cached = [
        qwen_server.chat(messages=turn, max_tokens=1, extra_body={"cache_salt": salt})
        .usage.prompt_tokens_details.cached_tokens
        for salt in ("user-1", "user-1", "user-2")
    ]
    assert cached[0] == 0 and cached[1] > 0 and cached[2] == 0
    # The same request salt under another key is another tenant's salt.
    other = qwen_server.chat(api_key=KEY_B, messages=turn, max_tokens=1, extra_body={"cache_salt": "user-1"})
    assert other.usage.prompt_tokens_details.cached_tokens == 0
