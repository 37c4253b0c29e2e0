"""The Responses API over a WebSocket, as Codex's built-in `openai` provider speaks it (codex-rs
`codex-api/src/endpoint/responses_websocket.rs`): `GET /v1/responses` upgraded to a WebSocket, authenticated by the
handshake's headers. The client sends one text message per request, `{"type": "response.create", ...}` with the
fields of a `POST /v1/responses` body (and `generate: false` for a warm-up: the prompt is prefilled into the cache,
nothing is generated, the response has no output), and reads that response's events, one text message each, exactly the SSE
events' data (`response.created` ... `response.completed`), before it sends the next. A request that fails is one
`{"type": "error", "status": 4xx, "error": {...}}` message (what codex-rs maps back to an HTTP error); the connection
stays open. `response.processed` acknowledgements are accepted and ignored.

The same pipeline as HTTP: the body limits, validation, the tenant's salt and budgets, the prepare lanes and the
engine; a client that goes away aborts its request. Each connection remembers the responses it produced, stored or
not, so that a later `response.create` on it can continue one with `previous_response_id` and send only the new
input (what OpenAI's WebSocket mode allows); other ids are looked up in the server's store as over HTTP.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import orjson
from starlette.websockets import WebSocket, WebSocketDisconnect

from server.api.compaction import CompactionSealer
from server.api.protocol import APIError
from server.api.responses import plan_response, prefill_events, response_events
from server.api.responses_input import ResponseStore
from server.api.responses_protocol import ResponsesRequest
from server.http.http_io import parse_body, parse_json
from server.pipeline.context import ServingContext
from server.pipeline.generation import submit

log = logging.getLogger("kvserve.server")
CREATE = "response.create"
IGNORED = ("response.processed",)  # acknowledgements a client may send; they ask for nothing


class ConnectionResponses(ResponseStore):
    """One connection's responses (the last few of each tenant), whatever their `store`, in front of the server's
    store: stored ones are kept there too, and ids this connection does not know are looked up there."""

    def __init__(self, shared: ResponseStore, capacity: int = 4) -> None:
        super().__init__(capacity)
        self._shared = shared

    def remember(self, salt: str | None, response_id: str, messages: list[dict], stored: bool) -> None:
        self.put(salt, response_id, messages)
        self._shared.remember(salt, response_id, messages, stored)

    def history(self, salt: str | None, response_id: str) -> list[dict]:
        try:
            return super().history(salt, response_id)
        except APIError:
            return self._shared.history(salt, response_id)


def error_message(exc: APIError) -> dict[str, Any]:
    """A failed request's one message, in the shape codex-rs reads as an HTTP error with that status."""
    return {"type": "error", "status": exc.status, "error": {"type": exc.type, "code": exc.code,
                                                              "message": exc.message, "param": exc.param}}


async def serve_responses(websocket: WebSocket, ctx: ServingContext, shared: ResponseStore,
                          sealer: CompactionSealer, salt_for: Callable[[WebSocket], str | None]) -> None:
    """Answer ``websocket``'s requests one after another until it closes (the handshake was authenticated:
    ``websocket.state.api_key`` is its key)."""
    await websocket.accept(headers=[(b"openai-model", ctx.model_name.encode())])
    responses = ConnectionResponses(shared)
    try:
        while True:
            raw = await _receive(websocket)
            try:
                await _answer(websocket, ctx, raw, responses, sealer, salt_for(websocket))
            except APIError as exc:
                await websocket.send_text(orjson.dumps(error_message(exc)).decode())
    except (WebSocketDisconnect, OSError):  # the client went away (while its response streamed: aborted)
        return


async def _receive(websocket: WebSocket) -> bytes:
    message = await websocket.receive()
    if message["type"] == "websocket.disconnect":
        raise WebSocketDisconnect(message.get("code", 1000))
    text, data = message.get("text"), message.get("bytes")
    return text.encode() if text is not None else data or b""


async def _answer(websocket: WebSocket, ctx: ServingContext, raw: bytes, responses: ConnectionResponses,
                  sealer: CompactionSealer, salt: str | None) -> None:
    limits = ctx.settings.limits
    if len(raw) > limits.body_bytes:
        raise APIError(413, f"the message is {len(raw)} bytes; the limit is {limits.body_bytes}",
                       code="request_too_large")
    body = await parse_json(raw, limits, websocket.state.api_key)
    kind = body.get("type") if isinstance(body, dict) else None
    if kind in IGNORED:
        return
    if kind != CREATE:
        raise APIError(400, f"a message's type must be '{CREATE}', not {kind!r}", param="type")
    warm_up = body.get("generate") is False  # a warm-up (Codex's prewarm): prefill the prompt, generate nothing
    body = {key: value for key, value in body.items() if key not in ("type", "generate")}
    req = parse_body(ResponsesRequest, body)
    if warm_up:
        req = req.model_copy(update={"max_output_tokens": 1})
    plan = await ctx.prepare(plan_response, ctx, req, body, salt, responses, websocket.headers, sealer)
    stream = await submit(ctx, [plan.chat.generation])
    try:
        events = (prefill_events if warm_up else response_events)(ctx, plan, stream, responses)
        async for event in events:
            await websocket.send_text(orjson.dumps(event).decode())
    finally:
        stream.abort()  # no-op once finished; a client gone mid-stream frees its blocks at once
