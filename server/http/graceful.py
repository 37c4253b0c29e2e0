"""uvicorn's server, telling the app when a shutdown begins (`server.http.http_io.Draining`): what still runs a moment
before the grace period (`--shutdown-timeout`) ends gets the API's 503 (a stream its error event) instead of a
connection cut off, and nothing that prepares a request (a grammar compiling) outlives the shutdown."""
from __future__ import annotations

import socket

import uvicorn
from fastapi import FastAPI

from server.http.connections import ConnectionLimits, uvicorn_settings


class GracefulServer(uvicorn.Server):
    """``connection_limits``: the bounds on request heads, idle and open connections (server/http/connections.py)."""

    def __init__(self, app: FastAPI, connection_limits: ConnectionLimits = ConnectionLimits(), **config) -> None:
        super().__init__(uvicorn.Config(app, **uvicorn_settings(connection_limits), **config))
        self._draining = app.state.draining

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._draining.start(self.config.timeout_graceful_shutdown)
        await super().shutdown(sockets)
