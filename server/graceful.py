"""uvicorn's server, telling the app when a shutdown begins (`server.http_io.Draining`): what still runs a moment
before the grace period (`--shutdown-timeout`) ends gets the API's 503 (a stream its error event) instead of a
connection cut off, and nothing that prepares a request (a grammar compiling) outlives the shutdown."""
from __future__ import annotations

import socket

import uvicorn
from fastapi import FastAPI


class GracefulServer(uvicorn.Server):
    def __init__(self, app: FastAPI, **config) -> None:
        super().__init__(uvicorn.Config(app, **config))
        self._draining = app.state.draining

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._draining.start(self.config.timeout_graceful_shutdown)
        await super().shutdown(sockets)
