"""The `/v1/caches` routes (named caches, server/cache/named_caches.py): create (prefill and pin), list, show, delete."""
from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request

from engine.retention import CachePin, Retention
from engine.sampling_params import SamplingParams
from server.pipeline.async_engine import EngineRequest
from server.pipeline.plan import chat_template_kwargs, render_turn
from server.pipeline.context import Served, new_request_id
from server.pipeline.generation import Generation, outputs, submit
from server.http.http_io import parse_body, read_json
from server.cache.named_caches import CreateCacheRequest, NamedCache
from server.http.openapi import request_body
from server.pipeline.turn import Turn


def add_cache_routes(api: APIRouter) -> None:
    @api.post("/v1/caches", openapi_extra=request_body(CreateCacheRequest))
    async def create_cache(request: Request, ctx: Served) -> dict[str, Any]:
        """Prefill a prefix once and pin it under a name; requests continue it with `cached_content`."""
        req = parse_body(CreateCacheRequest, await read_json(request, ctx.settings.limits))
        ctx.check_model(req.model)
        ttl = req.ttl_seconds()
        salt = ctx.salt_for(request, None)
        ctx.named_caches.check_free(salt, req.name)

        def render_and_encode() -> list[int]:
            turn = Turn(messages=req.messages, tools=req.tools, add_generation_prompt=False,
                        template_kwargs=chat_template_kwargs(ctx.family, req.chat_template_kwargs))
            return ctx.encode(render_turn(ctx, turn))

        ids = await ctx.prepare(render_and_encode)
        budget = ctx.named_cache_budget()
        ctx.named_caches.check_budget(salt, len(ids), *budget)  # before the prefill
        pin = Retention((CachePin(len(ids), ttl),), tenant=ctx.retention_tenant(salt))
        prompt = Generation(EngineRequest(new_request_id("cache"), ids, SamplingParams(max_tokens=1, temperature=0.0),
                                      salt, pin))
        stream = await submit(ctx, [prompt])
        async for _ in outputs(stream, [prompt]):
            pass
        now = time.time()
        cache = NamedCache(req.name, salt, req.messages, req.tools, ttl, ids, now, now)
        ctx.named_caches.add(cache, *budget)
        return cache.card(cached_tokens=prompt.num_cached_tokens)

    @api.get("/v1/caches")
    async def list_caches(request: Request, ctx: Served) -> dict[str, Any]:
        return {"object": "list", "data": [c.card() for c in ctx.named_caches.list(ctx.salt_for(request, None))]}

    @api.get("/v1/caches/{name}")
    async def get_cache(request: Request, ctx: Served, name: str) -> dict[str, Any]:
        """The cache, with how many of its tokens the KV cache holds right now (`cached_tokens`)."""
        cache = ctx.named_caches.get(ctx.salt_for(request, None), name)
        return cache.card(cached_tokens=await ctx.engine.num_cached_tokens(cache.token_ids, cache.salt))

    @api.delete("/v1/caches/{name}")
    async def delete_cache(request: Request, ctx: Served, name: str) -> dict[str, Any]:
        """Forget the name and unpin its blocks (they stay cached as ordinary blocks)."""
        cache = ctx.named_caches.remove(ctx.salt_for(request, None), name)
        await ctx.engine.pin(cache.token_ids, cache.salt, 0)
        return {"object": "cache.deleted", "name": name, "deleted": True}
