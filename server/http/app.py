"""The FastAPI app: OpenAI-compatible and Anthropic endpoints in front of one engine thread.

Every error, including malformed bodies, unknown routes and engine rejections, is answered in the shape of the API
that was called: Anthropic's `{"type": "error", "error": {"type", "message"}}` under `/v1/messages`, the OpenAI
shape `{"error": {"message", "type", "param", "code"}}` everywhere else; bad input is always a 4xx, never a 500.
"""
from __future__ import annotations

import asyncio
import gc
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from datetime import datetime, timezone
from functools import partial
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request, WebSocket
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.multimodal import ImagePrompt
from server.api.anthropic_protocol import (
    CountTokensRequest,
    MessagesRequest,
    anthropic_error_body,
    anthropic_error_event,
)
from server.pipeline.async_engine import RequestStream
from server.api.caches_api import add_cache_routes
from server.api.chat import chat_turn, complete_chat, stream_chat, tokenize_turn
from server.pipeline.plan import plan_turn, render_turn
from server.pipeline.images import expand, prompt_text, turn_images
from server.api.completions import complete_text, plan_completion, stream_text
from server.pipeline.context import Served, ServerSettings, ServingContext
from server.pipeline.generation import Generation, submit
from server.http.http_io import (
    Draining,
    EngineStreamingResponse,
    openai_error_event,
    parse_body,
    read_json,
    until_disconnect,
)
from server.inspector.routes import add_inspector_routes
from server.api.messages import complete_messages, count_tokens, plan_messages, stream_messages
from server.cache.named_caches import CreateCacheRequest
from server.http.responses_ws import serve_responses
from server.http.openapi import add_openapi_route, declare_request_bodies, request_body
from server.api.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from server.api.compaction import CompactionSealer
from server.api.responses import compact_response, complete_response, plan_response, stream_response
from server.api.responses_input import ResponseStore
from server.api.responses_protocol import CompactRequest, ResponsesRequest, responses_error_event
from server.api.router_api import add_router_routes
from server.cache.session import prompt_cache_key_session

log = logging.getLogger("kvserve.server")
M = TypeVar("M", bound=BaseModel)  # an API's request model
P = TypeVar("P")  # its plan


ANTHROPIC_PREFIX = "/v1/messages"


def _is_anthropic(request: Request) -> bool:
    return request.url.path.startswith(ANTHROPIC_PREFIX)


def _error_response(request: Request, exc: APIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
    body = anthropic_error_body(exc) if _is_anthropic(request) else exc.body()
    return JSONResponse(body, status_code=exc.status, headers=headers)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return _error_response(request, exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error_response(request, APIError(exc.status_code, str(exc.detail), type=kind))

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return _error_response(request, APIError(500, f"internal error: {exc!r}", type="server_error"))


class _Auth:
    """API-key check, as `Authorization: Bearer <key>` (OpenAI clients) or `x-api-key: <key>` (Anthropic clients);
    returns the caller's key (its tenant), or None when the server has no keys."""

    def __init__(self, keys: tuple[str, ...]) -> None:
        self._keys = [key.encode() for key in keys]

    def __call__(self, request: Request) -> str | None:
        if not self._keys:
            return None
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = (token if scheme.lower() == "bearer" else request.headers.get("x-api-key", "")).strip().encode()
        # compare_digest on every key: the time taken does not tell which key (or how much of one) matched.
        matched = [hmac.compare_digest(given, key) for key in self._keys]
        if not any(matched):
            raise APIError(401, "missing or invalid API key (send 'Authorization: Bearer <key>' or 'x-api-key: <key>')",
                           type="authentication_error", code="invalid_api_key")
        return given.decode()


async def generate(
    ctx: ServingContext, request: Request, api_model: type[M], plan: Callable[[M, dict[str, Any]], P],
    prompts: Callable[[P], list[Generation]], complete: Callable[[P, RequestStream], Awaitable[dict[str, Any]]],
    events: Callable[[P, RequestStream], AsyncIterator[str]],
    error_event: Callable[[APIError], str] = openai_error_event,
) -> Response:
    """The one route handler of the generating APIs: body -> the API's request -> its plan (prepared off the
    event loop) -> the engine -> one JSON body, or SSE events in the API's shape (`error_event` once the 200 is
    out). A client that leaves, at any point, aborts what it started."""
    body = await read_json(request, ctx.settings.limits)
    req = parse_body(api_model, body)
    planned = await until_disconnect(request, ctx.prepare(plan, req, body))
    stream = await until_disconnect(request, submit(ctx, prompts(planned)))
    if req.stream:
        return EngineStreamingResponse(events(planned, stream), on_close=stream.abort, error_event=error_event)
    try:
        return JSONResponse(await until_disconnect(request, complete(planned, stream)))
    finally:
        stream.abort()  # no-op once finished; covers a cancellation before the work started


def _model_card(ctx: ServingContext, request: Request) -> dict[str, Any]:
    """OpenAI's model object, or Anthropic's for clients that send `anthropic-version`."""
    if "anthropic-version" in request.headers:
        created = datetime.fromtimestamp(ctx.created, timezone.utc).isoformat().replace("+00:00", "Z")
        return {"type": "model", "id": ctx.model_name, "display_name": ctx.model_name, "created_at": created}
    return {"id": ctx.model_name, "object": "model", "created": ctx.created, "owned_by": "kvserve",
            "max_model_len": ctx.max_model_len}


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    """The engine thread starts with the app and stops (aborting what still runs) when uvicorn shuts it down, after
    in-flight responses drained."""
    ctx: ServingContext = app.state.ctx
    ctx.engine.start()
    # Everything loaded so far (model, tokenizers, templates, the app) lives as long as the server: frozen, the
    # garbage collector stops re-scanning those hundreds of thousands of objects in every collection that the
    # per-token garbage of the streams triggers (a third of the event loop's time per token at 256 streams,
    # and each collection holds the GIL the engine thread needs).
    gc.collect()
    gc.freeze()
    sampler = asyncio.create_task(ctx.inspector.sample_forever(ctx.metrics.snapshot)) if ctx.inspector else None
    try:
        yield
    finally:
        if sampler is not None:
            sampler.cancel()
        ctx.close()  # compiles in progress end now: nothing that prepares a request outlives the shutdown
        await asyncio.to_thread(ctx.engine.shutdown)
        if ctx.recorder is not None:
            ctx.recorder.close()
        gc.unfreeze()  # a stopped server's objects can be collected


def create_app(ctx: ServingContext) -> FastAPI:
    """The app for one served model (``ctx``: its handlers take it as `Served`)."""
    app = FastAPI(title="kvserve", lifespan=_lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.ctx = ctx
    app.state.draining = Draining()  # started by the server at shutdown (server/http/graceful.py)
    app.state.responses = ResponseStore(ctx.settings.tenant_limits.stored_responses)  # for `previous_response_id`
    app.state.compactions = CompactionSealer(ctx.settings.compaction_key)  # seals and opens `compaction` items
    _install_error_handlers(app)
    _add_routes(app, ctx.settings, ui=ctx.inspector is not None)
    return app


def _add_routes(app: FastAPI, settings: ServerSettings, ui: bool) -> None:
    """Every route, from the operator's settings alone (no context in scope: handlers take theirs as `Served`)."""
    auth = _Auth(settings.api_keys + settings.operator_keys)

    def authenticate(request: Request) -> None:
        request.state.api_key = auth(request)

    # Everything but the probes needs a key (when the server has keys).
    api = APIRouter(dependencies=[Depends(authenticate)])

    @api.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionRequest))
    async def chat_completions(request: Request, ctx: Served) -> Response:
        return await generate(
            ctx, request, ChatCompletionRequest,
            lambda req, body: plan_turn(
                ctx, chat_turn(req, ctx.family, prompt_cache_key_session(req.prompt_cache_key, request.headers)),
                body, ctx.salt_for(request, req.cache_salt), int(time.time())),
            lambda plan: [plan.generation], partial(complete_chat, ctx), partial(stream_chat, ctx))

    @api.post("/v1/messages", openapi_extra=request_body(MessagesRequest))
    async def messages(request: Request, ctx: Served) -> Response:
        """Anthropic Messages (Claude Code also sends `?beta=true`, which changes nothing here)."""
        return await generate(
            ctx, request, MessagesRequest,
            lambda req, body: plan_messages(ctx, req, body, ctx.salt_for(request, None), request.headers),
            lambda plan: [plan.chat.generation], partial(complete_messages, ctx), partial(stream_messages, ctx),
            anthropic_error_event)

    @api.post("/v1/responses", openapi_extra=request_body(ResponsesRequest))
    async def responses(request: Request, ctx: Served) -> Response:
        """OpenAI Responses, stateless unless `store` (then `previous_response_id` can continue it)."""
        store: ResponseStore = request.app.state.responses
        return await generate(
            ctx, request, ResponsesRequest,
            lambda req, body: plan_response(ctx, req, body, ctx.salt_for(request, None), store, request.headers,
                                            request.app.state.compactions),
            lambda plan: [plan.chat.generation], lambda plan, stream: complete_response(ctx, plan, stream, store),
            lambda plan, stream: stream_response(ctx, plan, stream, store), responses_error_event)

    @app.websocket("/v1/responses")
    async def responses_websocket(websocket: WebSocket) -> None:
        """The Responses API over a WebSocket (server/http/responses_ws.py); a bad key is refused in the handshake."""
        ctx: ServingContext = websocket.app.state.ctx
        try:
            websocket.state.api_key = auth(websocket)  # type: ignore[arg-type]
        except APIError as exc:
            await websocket.send_denial_response(_error_response(websocket, exc))  # type: ignore[arg-type]
            return
        await serve_responses(websocket, ctx, websocket.app.state.responses, websocket.app.state.compactions,
                              lambda ws: ctx.salt_for(ws, None))  # type: ignore[arg-type]

    @api.post("/v1/responses/compact", openapi_extra=request_body(CompactRequest))
    async def responses_compact(request: Request, ctx: Served) -> Response:
        """The conversation compacted: its user messages and one sealed `compaction` item (server/api/compaction.py)."""
        store: ResponseStore = request.app.state.responses
        return await generate(
            ctx, request, CompactRequest,
            lambda req, body: plan_response(ctx, req, body, ctx.salt_for(request, None), store, request.headers,
                                            request.app.state.compactions, compact=True),
            lambda plan: [plan.chat.generation], partial(compact_response, ctx), None)  # type: ignore[arg-type]

    @api.post("/v1/completions", openapi_extra=request_body(CompletionRequest))
    async def completions(request: Request, ctx: Served) -> Response:
        return await generate(
            ctx, request, CompletionRequest,
            lambda req, body: plan_completion(ctx, req, body, ctx.salt_for(request, req.cache_salt), int(time.time())),
            lambda plan: plan.prompts, partial(complete_text, ctx), partial(stream_text, ctx))

    @api.post("/v1/messages/count_tokens", openapi_extra=request_body(CountTokensRequest))
    async def messages_count_tokens(request: Request, ctx: Served) -> dict[str, Any]:
        body = await read_json(request, ctx.settings.limits)
        return await ctx.prepare(count_tokens, ctx, parse_body(CountTokensRequest, body), ctx.salt_for(request, None))

    @api.get("/v1/models")
    async def list_models(request: Request, ctx: Served) -> dict[str, Any]:
        if "anthropic-version" in request.headers:
            return {"data": [_model_card(ctx, request)], "has_more": False, "first_id": ctx.model_name,
                    "last_id": ctx.model_name}
        return {"object": "list", "data": [_model_card(ctx, request)]}

    @api.get("/v1/models/{model:path}")
    async def get_model(request: Request, ctx: Served, model: str) -> dict[str, Any]:
        ctx.check_model(model)
        return _model_card(ctx, request)

    @app.get("/health")
    async def health(ctx: Served) -> JSONResponse:
        if not ctx.engine.alive:
            return JSONResponse({"status": "error", "error": repr(ctx.engine.error)}, status_code=503)
        return JSONResponse({"status": "ok", "model": ctx.model_name})

    @app.get("/metrics")
    async def metrics(ctx: Served) -> PlainTextResponse:
        return PlainTextResponse(ctx.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @api.post("/tokenize", openapi_extra=request_body(TokenizeRequest))
    async def tokenize(request: Request, ctx: Served) -> dict[str, Any]:
        """Token ids of a text prompt, or of a chat request's rendered prompt (shown too), and how many of them the
        caller's prefix cache holds right now."""
        body = await read_json(request, ctx.settings.limits)
        req = parse_body(TokenizeRequest, body)
        ctx.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "send exactly one of 'prompt' and 'messages'")

        def render_and_encode() -> tuple[str | None, ImagePrompt]:
            if req.messages is None:
                return req.prompt, ImagePrompt(ctx.encode(req.prompt))
            turn, images = turn_images(ctx.images, tokenize_turn(req, ctx.family))  # an image counts its tokens
            text = render_turn(ctx, turn)
            return text, expand(ctx.images, ctx.encode(prompt_text(ctx.images, text, images)), images)

        text, prompt = await ctx.prepare(render_and_encode)
        ids = prompt.token_ids
        salt = ctx.salt_for(request, None)
        cached = await ctx.engine.num_cached_tokens(ids, salt, prompt.images)
        result: dict[str, Any] = {"tokens": ids, "count": len(ids), "max_model_len": ctx.max_model_len,
                                  "cached_tokens": cached}
        if req.messages is not None:
            result["prompt"] = text
        return result

    @api.post("/detokenize", openapi_extra=request_body(DetokenizeRequest))
    async def detokenize(request: Request, ctx: Served) -> dict[str, Any]:
        req = parse_body(DetokenizeRequest, await read_json(request, ctx.settings.limits))
        ctx.check_model(req.model)

        def decode() -> str:
            vocab = len(ctx.tokenizer)
            bad = [t for t in req.tokens if not 0 <= t < vocab]
            if bad:
                raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param="tokens")
            return ctx.tokenizer.decode(req.tokens, skip_special_tokens=False)

        return {"prompt": await ctx.prepare(decode)}

    add_cache_routes(api)
    add_router_routes(app, api)
    add_openapi_route(app, api, settings.openapi)
    if ui:
        add_inspector_routes(app, api, settings)
    app.include_router(api)
    declare_request_bodies(app, [ChatCompletionRequest, CompletionRequest, MessagesRequest, CountTokensRequest,
                                 ResponsesRequest, CompactRequest, TokenizeRequest, DetokenizeRequest, CreateCacheRequest])
