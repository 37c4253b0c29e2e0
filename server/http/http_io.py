"""HTTP plumbing: bounded, strict body reading, and responses that abort their engine requests the moment the client
goes away (freeing the KV pages at once instead of generating into a closed socket) or the server's shutdown grace
period runs out (`Draining`: then they end with the API's 503, a stream with its error event, never cut off)."""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import anyio
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from server import json_text
from server.cache.cache_salt import tenant_salt
from server.pipeline.context import LARGE_REQUEST_BYTES, body_bytes, prepare_tenant
from server.http.limits import RequestLimits, check_body
from server.api.protocol import APIError, validation_error
from server.api.request_fields import refuse_unsupported
from server.http.sse import SSE_DONE, sse

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")


async def read_json(request: Request, limits: RequestLimits) -> Any:
    """The body as JSON: 413 past the body limit (checked before reading when Content-Length says so), 400 for
    bytes that are not UTF-8 or not JSON, nested too deep, or holding a lone surrogate. A large body is parsed off
    the event loop, and its size chooses the lane that prepares the request (`ServingContext.prepare`)."""
    limit = limits.body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isascii() and declared.isdigit() and (len(declared) > 18 or
                                                                           int(declared) > limit):
        raise APIError(413, f"request body is {declared} bytes; the limit is {limit}", code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")
        chunks.append(chunk)
    return await parse_json(b"".join(chunks), limits, getattr(request.state, "api_key", None))


async def parse_json(raw: bytes, limits: RequestLimits, api_key: str | None) -> Any:
    """A body (or a WebSocket message) within the limits as JSON, as `read_json` parses it; its size and its
    tenant (``api_key``) choose the lane that prepares the request."""
    body_bytes.set(len(raw))
    prepare_tenant.set(tenant_salt(api_key))
    if len(raw) > LARGE_REQUEST_BYTES:
        return await asyncio.to_thread(_parse_json, raw, limits)
    return _parse_json(raw, limits)


def _parse_json(raw: bytes, limits: RequestLimits) -> Any:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(400, f"request body is not valid UTF-8 (byte {exc.start})", code="invalid_encoding") from None
    try:
        body = json_text.loads(text, max_depth=None)
    except json_text.TooDeep:
        raise APIError(400, f"the request body nests arrays and objects deeper than {limits.json_depth} levels",
                       code="limit_exceeded") from None
    except json.JSONDecodeError as exc:
        raise APIError(400, f"request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}",
                       code="invalid_json") from None
    except RecursionError:
        raise APIError(400, f"the request body nests arrays and objects deeper than {limits.json_depth} levels",
                       code="limit_exceeded") from None
    check_body(raw, body, limits)
    return body


def parse_body(model: type[M], body: Any) -> M:
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object", code="invalid_json")
    api = getattr(model, "api", None)
    if api is not None:
        refuse_unsupported(api, body)
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None


SHUTTING_DOWN = APIError(503, "the server is shutting down; send the request again (to another replica, or once "
                         "this one is back)", type="server_error", code="server_shutting_down")


class Draining:
    """A server's shutdown, as its app sees it (``app.state.draining``): `start` is called when the shutdown begins,
    with the grace period that running requests get; `cutoff` is set a moment before that period ends, and whatever
    still runs then ends with `SHUTTING_DOWN` in its API's shape, before the server would cut its connection."""

    MARGIN_S = 1.0  # at most; a quarter of a short grace period

    def __init__(self) -> None:
        self.cutoff = asyncio.Event()

    def start(self, grace_s: float | None) -> None:
        if grace_s is not None:  # None: the server waits for every request, however long
            delay = max(0.0, grace_s - min(self.MARGIN_S, grace_s / 4))
            asyncio.get_running_loop().call_later(delay, self.cutoff.set)


def _draining(app: Any) -> Draining | None:
    return getattr(getattr(app, "state", None), "draining", None)


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Run `work` (preparing a request, a non-streaming completion) but cancel it if the client disconnects first
    (499) or the server's shutdown reaches its cutoff (503); its cleanup aborts the engine request. The body must
    have been read already, so the next ASGI message is the disconnect."""
    task = asyncio.ensure_future(work)
    watchers = [asyncio.ensure_future(_wait_for_disconnect(request.receive))]
    draining = _draining(request.scope.get("app"))
    if draining is not None:
        watchers.append(asyncio.ensure_future(draining.cutoff.wait()))
    try:
        await asyncio.wait({task, *watchers}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for watcher in watchers:
            watcher.cancel()
        if not task.done():
            task.cancel()  # its cleanup (the abort) runs inside it: wait for that
            await asyncio.wait({task})
    if task.cancelled():
        if draining is not None and draining.cutoff.is_set():
            raise SHUTTING_DOWN
        raise APIError(499, "client disconnected", code="client_disconnected")
    return task.result()


def openai_error_event(exc: APIError) -> str:
    """OpenAI clients raise on `data: {"error": ...}`."""
    return sse(exc.body()) + SSE_DONE


async def _sse_errors(events: AsyncIterator[str], error_event: Callable[[APIError], str]) -> AsyncIterator[str]:
    """Once the 200 is sent an error can only be an event, in the API's own shape."""
    try:
        async for event in events:
            yield event
    except APIError as exc:
        yield error_event(exc)


class EngineStreamingResponse(StreamingResponse):
    """SSE that watches for the client's disconnect while generating (whatever the ASGI version) and calls
    `on_close` however the stream ends, so an abandoned request never keeps running or holding pages. At the
    server's shutdown cutoff (`Draining`) it ends with the API's error event for `SHUTTING_DOWN`."""

    def __init__(
        self, events: AsyncIterator[str], on_close: Callable[[], None],
        error_event: Callable[[APIError], str] = openai_error_event,
    ) -> None:
        super().__init__(_sse_errors(events, error_event), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._events = events
        self._on_close = on_close
        self._error_event = error_event

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        draining = _draining(scope.get("app"))
        sent = {"start": False, "end": False}
        cut = False

        async def tracked(message: dict) -> None:
            sent["start"] = sent["start"] or message["type"] == "http.response.start"
            sent["end"] = message["type"] == "http.response.body" and not message.get("more_body", False)
            await send(message)

        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    try:
                        await self.stream_response(tracked)
                    except OSError:  # the client went away mid-write
                        pass
                    group.cancel_scope.cancel()

                async def watch() -> None:
                    await _wait_for_disconnect(receive)
                    group.cancel_scope.cancel()

                async def shutdown() -> None:
                    nonlocal cut
                    await draining.cutoff.wait()
                    cut = True
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                group.start_soon(watch)
                if draining is not None:
                    group.start_soon(shutdown)
            if cut and sent["start"] and not sent["end"]:
                await tracked({"type": "http.response.body", "body": self._error_event(SHUTTING_DOWN).encode(),
                               "more_body": True})
                await tracked({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the client went away meanwhile
            pass
        finally:
            self._on_close()
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
            await self._events.aclose()  # type: ignore[attr-defined]
