"""What cache-aware routers ask of a replica, in the shapes vLLM's router (`vllm-router`) parses: its load, its
identity and block size, where its KV events are published (so a `kv_aware` router finds them without flags), and
the exact token ids a chat request becomes (so the router can score the request against those events).

    GET  /get_load                    {"load": running + waiting sequences}          (no key needed, like /health)
    GET  /get_server_info             {"model_id", "instance_id", "kv_block_size", ...}
    GET  /kv_event_sources            {"0": {"endpoint", "replay_endpoint", "topic", "publisher": "zmq", ...}}
    POST /v1/chat/completions/render  {"model", "token_ids"}: the prompt /v1/chat/completions would run

docs/ROUTERS.md shows each router these serve, as run here.
"""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, FastAPI, Request

from server.api.chat import chat_turn
from server.pipeline.plan import turn_prompt_text
from server.pipeline.context import Served
from server.http.http_io import parse_body, read_json
from server.http.openapi import request_body
from server.api.protocol import APIError, ChatCompletionRequest

# vLLM's KV event source descriptor: the wire this replica speaks (engine/kv/events.py).
KV_EVENTS_WIRE = {"publisher": "zmq", "encoding": "msgpack", "schema_version": 1, "enable_kv_cache_events": True}


def add_router_routes(app: FastAPI, api: APIRouter) -> None:
    """``app`` takes the probe (no API key), ``api`` the rest."""

    @app.get("/get_load")
    async def get_load(ctx: Served) -> dict[str, int]:
        stats = ctx.metrics.snapshot()
        return {"load": stats.requests_running + stats.requests_waiting}

    @api.get("/get_server_info")
    async def get_server_info(ctx: Served) -> dict[str, Any]:
        return {"model_id": ctx.model_name, "model_path": ctx.model_name, "instance_id": ctx.instance_id,
                "kv_block_size": ctx.engine.facts.block_size, "max_model_len": ctx.max_model_len}

    @api.get("/kv_event_sources")
    async def kv_event_sources(ctx: Served) -> dict[str, Any]:
        facts = ctx.engine.facts
        if not facts.kv_events_endpoint:
            raise APIError(404, "this replica publishes no KV events (start it with --kv-events-endpoint)",
                           type="not_found_error")
        return {"0": {"endpoint": facts.kv_events_endpoint, "replay_endpoint": facts.kv_events_replay_endpoint,
                      "topic": facts.kv_events_topic, **KV_EVENTS_WIRE}}

    @api.post("/v1/chat/completions/render", openapi_extra=request_body(ChatCompletionRequest))
    async def render_chat_completion(request: Request, ctx: Served) -> dict[str, Any]:
        """Render and tokenize only: the same steps, in the same order, as /v1/chat/completions."""
        body = await read_json(request, ctx.settings.limits)
        req = parse_body(ChatCompletionRequest, body)

        def token_ids() -> list[int]:
            _, text = turn_prompt_text(ctx, chat_turn(req, ctx.family), ctx.salt_for(request, req.cache_salt))
            return ctx.encode(text)

        return {"model": ctx.model_name, "token_ids": await ctx.prepare(token_ids)}
