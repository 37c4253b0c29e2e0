"""`kvserve serve --ui`: the inspector's page and its JSON API.

    GET /ui                        the page (static HTML, CSS and a script from server/inspector/static; no data)
    GET /ui/api/sessions           the sessions the caller may see, newest first
    GET /ui/api/sessions/{id}      one session's requests, in order
    GET /ui/api/requests/{id}      one request: its prompt token by token, what the cache served, its divergence
    GET /ui/api/cache              blocks per tier over time, evictions by cause, the largest cached prefixes
    GET /ui/api/updates?after=N    the newest request's number and the sessions with requests after N (the page
                                   polls it: no connection stays open, so a shutdown never waits on a viewer)

The page itself holds nothing, so it loads without a key; everything it shows comes from /ui/api/*, which needs the
key like every endpoint (the page asks for it, or takes it from the URL's fragment, `/ui#key=...`, which browsers
never send to the server).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from server.cache.cache_salt import tenant_salt
from server.pipeline.context import Served, ServerSettings
from server.inspector import views
from server.api.protocol import APIError

STATIC_DIR = Path(__file__).parent / "static"
_STATIC_TYPES = {"index.html": "text/html; charset=utf-8", "inspector.js": "text/javascript; charset=utf-8",
                 "inspector.css": "text/css; charset=utf-8"}
# Nothing from elsewhere (no CDN) and no inline script; inline styles size the bars.
_CSP = "default-src 'self'; img-src 'self' data:; style-src 'self' 'unsafe-inline'; script-src 'self'; base-uri 'none'"
LARGEST_PREFIXES = 12
# Finding the longest cached prefixes walks the whole device tree on the engine thread (tens of ms at 100k blocks):
# every viewer of the cache page shares one walk for this long.
PREFIXES_TTL_S = 5.0


def add_inspector_routes(app: FastAPI, api: APIRouter, settings: ServerSettings) -> None:
    """``app`` takes the page (no key), ``api`` the JSON (the key); the served context has an inspector."""
    operators = set(settings.operator_keys)

    def viewer(request: Request) -> views.Viewer:
        key = request.state.api_key
        return views.Viewer(tenant_salt(key), operator=key is not None and key in operators)

    @app.get("/ui", include_in_schema=False)
    async def page() -> Response:
        return _static("index.html")

    @app.get("/ui/static/{name}", include_in_schema=False)
    async def static(name: str) -> Response:
        return _static(name)

    # Views are plain JSON already: JSONResponse skips FastAPI's per-value encoding (a 1,000-request session).
    @api.get("/ui/api/sessions", include_in_schema=False)
    async def sessions(request: Request, ctx: Served) -> JSONResponse:
        return JSONResponse(views.sessions_view(ctx.inspector, viewer(request)))

    @api.get("/ui/api/sessions/{key}", include_in_schema=False)
    async def session(request: Request, ctx: Served, key: str) -> JSONResponse:
        inspector = ctx.inspector
        found = views.visible_session(inspector, viewer(request), key)
        if found is None:
            raise _not_found(f"no session '{key}' (it may have left the inspector's window of "
                             f"{inspector.max_requests} requests)")
        return JSONResponse(views.session_view(inspector, found))

    @api.get("/ui/api/requests/{request_id}", include_in_schema=False)
    async def inspected_request(request: Request, ctx: Served, request_id: str) -> JSONResponse:
        inspector = ctx.inspector
        record = views.visible_request(inspector, viewer(request), request_id)
        if record is None:
            raise _not_found(f"no request '{request_id}' (it may have left the inspector's window of "
                             f"{inspector.max_requests} requests)")
        hashes = views.prompt_block_hashes(inspector, record)
        blocks_now, snapshots = await ctx.engine.blocks_now(hashes)
        return JSONResponse(views.request_view(inspector, record, ctx.token_texts, blocks_now, snapshots))

    largest_prefixes = _Recent(PREFIXES_TTL_S)

    @api.get("/ui/api/cache", include_in_schema=False)
    async def cache(request: Request, ctx: Served) -> JSONResponse:
        inspector = ctx.inspector
        inspector.sample(ctx.metrics.snapshot())
        prefixes, now = await largest_prefixes.get(lambda: ctx.engine.largest_prefixes(4 * LARGEST_PREFIXES))
        return JSONResponse(views.cache_view(inspector, viewer(request), prefixes, now, LARGEST_PREFIXES))

    @api.get("/ui/api/updates", include_in_schema=False)
    async def updates(request: Request, ctx: Served, after: int = 0) -> dict[str, Any]:
        who = viewer(request)
        if who.sees_all:
            seq, sessions = ctx.inspector.updated_sessions(after)
        else:  # numbered among the tenant's own requests: the global count would tell how busy the others are
            seq, sessions = ctx.inspector.updated_sessions_of(who.tenant, after)
        return {"seq": seq, "sessions": [s.key for s in sessions]}


class _Recent:
    """The last value an async function gave, reused while it is younger than ``ttl_s``."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._value: Any = None
        self._at = -float("inf")

    async def get(self, compute) -> Any:
        if time.monotonic() - self._at >= self.ttl_s:
            self._value, self._at = await compute(), time.monotonic()
        return self._value


def _static(name: str) -> Response:
    media_type = _STATIC_TYPES.get(name)
    if media_type is None:
        raise _not_found(f"no file '{name}'")
    return Response((STATIC_DIR / name).read_bytes(), media_type=media_type,
                    headers={"Content-Security-Policy": _CSP, "Cache-Control": "no-cache"})


def _not_found(message: str) -> APIError:
    return APIError(404, message, type="not_found_error")
