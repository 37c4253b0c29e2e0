"""The Responses API over a WebSocket (server/http/responses_ws.py) with the `websockets` client, as Codex's built-in
provider speaks it: the same events as SSE, one message each; a warm-up (`generate: false`) that prefills and answers
with no output; `previous_response_id` continuing a response of the same connection; a bad message is one error
message and the connection stays open; a bad key is refused in the handshake; another connection continues only a
stored response of its own tenant."""
from __future__ import annotations

import asyncio
import json

import pytest
import websockets

from tests.server.conftest import KEY_A, KEY_B, LiveServer

TERMINAL = ("response.completed", "response.incomplete", "error")


def _url(server: LiveServer) -> str:
    return server.base_url.replace("http://", "ws://") + "/v1/responses"


async def _request(ws, **body) -> list[dict]:
    """One request's messages, up to its last."""
    await ws.send(json.dumps({"type": "response.create", **body}))
    events = []
    while not events or events[-1]["type"] not in TERMINAL:
        events.append(json.loads(await ws.recv()))
    return events


def test_a_websocket_carries_requests_as_sse_carries_them(qwen_server: LiveServer) -> None:
    model = qwen_server.ctx.model_name
    developer = {"type": "message", "role": "developer", "content": "You are a coding agent. " * 12}
    user = {"type": "message", "role": "user", "content": "List the files."}

    async def talk() -> tuple[list[dict], list[dict], list[dict], list[dict]]:
        async with websockets.connect(_url(qwen_server), additional_headers={"Authorization": f"Bearer {KEY_A}"}) as ws:
            # Codex's order: its instructions as a warm-up, then the turn continuing it
            warm = await _request(ws, model=model, input=[developer], generate=False, store=False)
            turn = await _request(ws, model=model, previous_response_id=warm[-1]["response"]["id"], store=False,
                                  input=[user], max_output_tokens=3, temperature=0)
            bad = await _request(ws, model=model, input="hi", max_output_tokens=0)
            await ws.send(json.dumps({"type": "response.processed", "response_id": "x"}))  # an ack: no answer
            again = await _request(ws, model=model, input=[developer, user], max_output_tokens=3, temperature=0,
                                   store=False)
            return warm, turn, bad, again

    warm, turn, bad, again = asyncio.run(talk())
    assert [e["type"] for e in warm] == ["response.created", "response.completed"]
    assert warm[-1]["response"]["output"] == [] and warm[-1]["response"]["usage"]["output_tokens"] == 0
    types = [e["type"] for e in turn]
    assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert types[-1] == "response.incomplete" and [e["sequence_number"] for e in turn] == list(range(len(turn)))
    # the warm-up prefilled the instructions: the turn that continues it reads them from the cache
    assert turn[-1]["response"]["usage"]["input_tokens_details"]["cached_tokens"] >= 64
    assert bad == [{"type": "error", "status": 400, "error": bad[0]["error"]}]
    assert bad[0]["error"]["param"] == "max_output_tokens"
    # the same conversation sent whole gives the same reply as continued by previous_response_id
    assert again[-1]["response"]["output"] == [
        {**item, "id": again_item["id"]} for item, again_item in zip(turn[-1]["response"]["output"],
                                                                     again[-1]["response"]["output"])]


def test_a_bad_key_is_refused_in_the_handshake(qwen_server: LiveServer) -> None:
    async def connect(key: str) -> None:
        async with websockets.connect(_url(qwen_server), additional_headers={"Authorization": f"Bearer {key}"}):
            pass

    with pytest.raises(websockets.InvalidStatus) as refused:
        asyncio.run(connect("sk-wrong"))
    assert refused.value.response.status_code == 401
    asyncio.run(connect(KEY_B))  # another tenant's key connects


def test_another_connection_continues_only_a_stored_response_of_its_own_tenant(qwen_server: LiveServer) -> None:
    model = qwen_server.ctx.model_name

    async def first(store: bool) -> str:
        async with websockets.connect(_url(qwen_server), additional_headers={"Authorization": f"Bearer {KEY_A}"}) as ws:
            events = await _request(ws, model=model, input="hi", max_output_tokens=2, store=store)
            return events[-1]["response"]["id"]

    async def continued(key: str, previous: str) -> list[dict]:
        async with websockets.connect(_url(qwen_server), additional_headers={"Authorization": f"Bearer {key}"}) as ws:
            return await _request(ws, model=model, input="more", previous_response_id=previous, max_output_tokens=2)

    unstored, stored = asyncio.run(first(False)), asyncio.run(first(True))
    assert asyncio.run(continued(KEY_A, stored))[-1]["type"] == "response.incomplete"
    for key, previous in ((KEY_A, unstored), (KEY_B, stored)):  # kept by no one / another tenant's
        [error] = asyncio.run(continued(key, previous))
        assert error["status"] == 400 and error["error"]["param"] == "previous_response_id"
