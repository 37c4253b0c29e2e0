"""The OpenAPI schema of the generation routes. They read the raw body (bounded, and kept as sent for `--record`),
so FastAPI cannot see their request models; `declare_request_bodies` puts them into the schema, which documents
the API and drives the property-based fuzz test (tests/server/http/test_fuzz_schema.py)."""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

_REF = "#/components/schemas/{model}"


OPENAPI_MODES = ("key", "public", "off")


def add_openapi_route(app: FastAPI, api: APIRouter, mode: str) -> None:
    """`GET /openapi.json` as the operator chooses: behind the API key like every endpoint (``key``, the default),
    to anyone who can connect (``public``), or not at all (``off``). Call before ``api`` is included in ``app``."""
    if mode not in OPENAPI_MODES:
        raise ValueError(f"openapi must be one of {OPENAPI_MODES}, got {mode!r}")
    if mode == "off":
        return

    async def openapi_json(request: Request) -> JSONResponse:
        return JSONResponse(request.app.openapi())  # the app from the request: endpoints outlive their app

    (api if mode == "key" else app).add_api_route("/openapi.json", openapi_json, methods=["GET"],
                                                 include_in_schema=False)


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` for a route whose JSON body is `model`."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": _REF.format(model=model.__name__)}}}}}


def declare_request_bodies(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """Make `app.openapi()` include `models` (and the models they use) under components/schemas."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                body = model.model_json_schema(ref_template=_REF)
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
