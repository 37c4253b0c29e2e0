"""Named caches (`/v1/caches`) and cache_control validation: create (prefill + pin), continue by name on chat and
messages, list / show / delete, tenants apart; malformed marks are 400s in each API's shape."""
from __future__ import annotations

import anthropic
import pytest

from tests.server.conftest import KEY_B, LiveServer

SYSTEM = "You are a careful assistant for the kvserve project. " * 20
PREFIX = [{"role": "system", "content": SYSTEM},
          {"role": "user", "content": "Here is the repository map: " + "src/a.py " * 40}]


@pytest.fixture
def cache(qwen_server: LiveServer):
    with qwen_server.http() as http:
        http.delete("/v1/caches/repo-map")
        created = http.post("/v1/caches", json={"name": "repo-map", "model": "qwen3-tiny", "messages": PREFIX,
                                                "ttl": "1h"})
        assert created.status_code == 200, created.text
        yield created.json()
        http.delete("/v1/caches/repo-map")


def test_create_list_show_and_delete(qwen_server: LiveServer, cache):
    assert cache["object"] == "cache" and cache["name"] == "repo-map" and cache["ttl_seconds"] == 3600
    assert cache["tokens"] > 300 and cache["expires_at"] > cache["created"]
    with qwen_server.http() as http:
        assert [c["name"] for c in http.get("/v1/caches").json()["data"]] == ["repo-map"]
        shown = http.get("/v1/caches/repo-map").json()
        assert shown["cached_tokens"] == cache["tokens"] // 4 * 4  # every full block (block size 4) is held
        again = http.post("/v1/caches", json={"name": "repo-map", "messages": PREFIX})
        assert again.status_code == 409 and again.json()["error"]["code"] == "cache_exists"
        assert http.delete("/v1/caches/repo-map").json() == {"object": "cache.deleted", "name": "repo-map",
                                                              "deleted": True}
        assert http.get("/v1/caches/repo-map").status_code == 404
        assert http.delete("/v1/caches/repo-map").status_code == 404


def test_pinned_blocks_are_released_on_delete(qwen_server: LiveServer, cache):
    def retained() -> int:
        return qwen_server.stats().kv_blocks_retained

    before = retained()
    assert before >= cache["tokens"] // 4
    with qwen_server.http() as http:
        http.delete("/v1/caches/repo-map")
    assert retained() <= before - cache["tokens"] // 4


def test_chat_continues_a_named_cache(qwen_server: LiveServer, cache):
    question = [{"role": "user", "content": "Which file is first?"}]
    named = qwen_server.chat(messages=question, max_tokens=4, temperature=0, extra_body={"cached_content": "repo-map"})
    spelled_out = qwen_server.chat(messages=PREFIX + question, max_tokens=4, temperature=0)
    assert named.usage.prompt_tokens == spelled_out.usage.prompt_tokens
    assert named.usage.prompt_tokens_details.cached_tokens >= cache["tokens"] // 4 * 4
    assert named.choices[0].message.content == spelled_out.choices[0].message.content


def test_messages_continue_a_named_cache_and_count_tokens_agrees(qwen_server: LiveServer, cache):
    client = qwen_server.anthropic()
    question = [{"role": "user", "content": "Which file is first?"}]
    counted = client.messages.count_tokens(model="qwen3-tiny", messages=question,
                                           extra_body={"cached_content": "repo-map"})
    message = client.messages.create(model="qwen3-tiny", max_tokens=4, messages=question,
                                     extra_body={"cached_content": "repo-map", "temperature": 0})
    usage = message.usage
    prompt = usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens
    assert prompt == counted.input_tokens
    assert usage.cache_read_input_tokens >= cache["tokens"] // 4 * 4


def test_caches_are_per_tenant(qwen_server: LiveServer, cache):
    other = qwen_server.client(api_key=KEY_B)
    with pytest.raises(Exception) as caught:
        other.chat.completions.create(model="qwen3-tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                      extra_body={"cached_content": "repo-map"})
    assert getattr(caught.value, "status_code", None) == 404
    assert other.get("/caches", cast_to=object)["data"] == []


@pytest.mark.parametrize("body, message", [
    ({"name": "bad name!", "messages": PREFIX}, "name"),
    ({"name": "..", "messages": PREFIX}, "name"),  # a path segment clients drop: it could never be deleted
    ({"name": "x" * 129, "messages": PREFIX}, "name"),
    ({"name": "x", "messages": PREFIX, "ttl": "2h"}, "ttl"),
    ({"name": "x", "messages": PREFIX, "ttl": 0}, "ttl"),
    ({"name": "x", "messages": []}, "messages"),
    ({"name": "x", "messages": PREFIX, "model": "gpt-4"}, "does not exist"),
])
def test_bad_cache_requests(qwen_server: LiveServer, body, message):
    with qwen_server.http() as http:
        response = http.post("/v1/caches", json=body)
    assert 400 <= response.status_code < 500 and message in response.text


def test_chat_content_part_breakpoints_pin(qwen_server: LiveServer):
    qwen_server.reset_prefix_cache()
    before = qwen_server.stats().kv_blocks_retained
    parts = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral", "ttl": "5m"}}]
    qwen_server.chat(messages=[{"role": "system", "content": parts}, {"role": "user", "content": "hi"}],
                     max_tokens=2, temperature=0)
    assert qwen_server.stats().kv_blocks_retained >= before + 50  # ~220 tokens


@pytest.mark.parametrize("mark", [{"type": "persistent"}, {"type": "ephemeral", "ttl": "10m"}, "yes"])
def test_malformed_cache_control_is_a_400_in_each_shape(qwen_server: LiveServer, mark):
    block = {"type": "text", "text": "hi", "cache_control": mark}
    with pytest.raises(anthropic.BadRequestError) as caught:
        qwen_server.anthropic().messages.create(model="qwen3-tiny", max_tokens=2,
                                                messages=[{"role": "user", "content": [block]}])
    assert "cache_control" in str(caught.value)
    with qwen_server.http() as http:
        response = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [block]}]})
    assert response.status_code == 400 and "cache_control" in response.json()["error"]["message"]


def test_at_most_four_breakpoints(qwen_server: LiveServer):
    marked = [{"type": "text", "text": f"part {i}", "cache_control": {"type": "ephemeral"}} for i in range(5)]
    with pytest.raises(anthropic.BadRequestError) as caught:
        qwen_server.anthropic().messages.create(model="qwen3-tiny", max_tokens=2,
                                                messages=[{"role": "user", "content": marked}])
    assert "at most 4" in str(caught.value)
