"""What routers ask of a replica (server/api/router_api.py): load, identity, KV event sources, and the exact token ids
of a chat request. The routers themselves run in tests/bench/test_router.py."""
from __future__ import annotations

import httpx
import pytest

from engine.config import EngineConfig
from server.pipeline.context import ServerSettings, load_context
from tests.kv.test_kv_events import free_port
from tests.server.conftest import LiveServer, serve

TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file",
                                           "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                                          "required": ["path"]}}}]


def test_render_is_the_prompt_the_chat_endpoint_runs(qwen_server: LiveServer) -> None:
    messages = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "Read setup.py"}]
    with qwen_server.http() as http:
        rendered = http.post("/v1/chat/completions/render",
                             json={"model": "qwen3-tiny", "messages": messages, "tools": TOOLS}).json()
        plain = http.post("/v1/chat/completions/render", json={"messages": messages}).json()
        tokenized = http.post("/tokenize", json={"messages": messages}).json()
        wrong_model = http.post("/v1/chat/completions/render", json={"model": "gpt-4", "messages": messages})
    reply = qwen_server.chat(messages=messages, tools=TOOLS, max_tokens=1)
    assert rendered["model"] == "qwen3-tiny" and reply.usage.prompt_tokens == len(rendered["token_ids"])
    assert plain["token_ids"] == tokenized["tokens"] != rendered["token_ids"]  # the tools are in the prompt
    assert wrong_model.status_code == 404 and wrong_model.json()["error"]["code"] == "model_not_found"


def test_load_and_server_info(qwen_server: LiveServer) -> None:
    qwen_server.wait_until_idle()
    assert httpx.get(qwen_server.base_url + "/get_load").json() == {"load": 0}  # a probe: no key needed
    assert httpx.get(qwen_server.base_url + "/get_server_info").status_code == 401
    with qwen_server.http() as http:
        info = http.get("/get_server_info").json()
        sources = http.get("/kv_event_sources")
    assert info["model_id"] == "qwen3-tiny" and info["kv_block_size"] == 4
    assert info["instance_id"].startswith("kvserve-")
    # Every chat response names the process that served it (a router's client can tell which replica answered).
    assert qwen_server.chat(messages=[{"role": "user", "content": "hi"}], max_tokens=1).system_fingerprint == \
        info["instance_id"]
    stream = qwen_server.chat(messages=[{"role": "user", "content": "hi"}], max_tokens=1, stream=True)
    assert {chunk.system_fingerprint for chunk in stream} == {info["instance_id"]}
    assert sources.status_code == 404 and "--kv-events-endpoint" in sources.json()["error"]["message"]


@pytest.mark.slow
def test_kv_event_sources_name_the_publisher() -> None:
    port, replay_port = free_port(), free_port()
    config = EngineConfig(block_size=16, num_kv_blocks=64, max_model_len=256, kv_events_topic="kv",
                          kv_events_endpoint=f"tcp://*:{port}", kv_events_replay_endpoint=f"tcp://*:{replay_port}")
    with serve(load_context("qwen3-tiny", config, ServerSettings())) as url:
        sources = httpx.get(url + "/kv_event_sources").json()
    assert sources == {"0": {"endpoint": f"tcp://*:{port}", "replay_endpoint": f"tcp://*:{replay_port}",
                             "topic": "kv", "publisher": "zmq", "encoding": "msgpack", "schema_version": 1,
                             "enable_kv_cache_events": True}}
