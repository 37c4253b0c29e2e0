"""The operator's bounds on connections, enforced in uvicorn's HTTP protocol before any request reaches the app (and
so before authentication): a request head (request line + headers) larger than `--max-header-bytes` gets 431 and the
connection closes, having buffered at most that plus one read; a connection that has not sent a whole request head
within `--header-timeout` seconds of connecting (or of its last response) is closed, however it trickles bytes; an
idle keep-alive connection closes after `--keep-alive-timeout` (uvicorn's own `timeout_keep_alive`); and beyond
`--max-connections` open connections a new one gets 503 and is closed at once, so idle sockets cannot use up the
file descriptors. uvicorn's httptools protocol has no header limit of its own (h11's `h11_max_incomplete_event_size`
is set too, for servers running h11), and its keep-alive timer only runs after a first response.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

from uvicorn.protocols.http.h11_impl import H11Protocol

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as _DefaultProtocol
except ImportError:  # pragma: no cover - httptools is pinned; uvicorn falls back to h11 without it
    _DefaultProtocol = H11Protocol  # type: ignore[assignment,misc]


def _flag(name: str, help_text: str) -> dict[str, str]:
    return {"flag": name, "help": help_text}


@dataclass(frozen=True)
class ConnectionLimits:
    """Each field's ``metadata`` names its `kvserve serve` flag (server/cli/serve.py builds them from it)."""

    header_bytes: int = field(default=64 * 1024, metadata=_flag(
        "--max-header-bytes", "largest request head (request line and headers); larger ones get 431"))
    header_timeout_s: float = field(default=30.0, metadata=_flag(
        "--header-timeout", "seconds a connection may take to send a whole request head, from connecting or from its "
        "last response; then it is closed"))
    keep_alive_s: float = field(default=5.0, metadata=_flag(
        "--keep-alive-timeout", "seconds an idle keep-alive connection stays open after a response"))
    connections: int = field(default=1024, metadata=_flag(
        "--max-connections", "most open connections; a new one beyond it gets 503 and is closed"))

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value <= 0:
                raise ValueError(f"connection limit {name} must be positive, got {value}")


def _error_response(status: int, reason: str, message: str, code: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error" if status < 500 else
                                 "server_error", "param": None, "code": code}}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode() + body


class _BoundedProtocol:
    """Mixed into uvicorn's HTTP protocol (one instance per connection); `limits` is set by `bounded_protocol`."""

    limits: ConnectionLimits

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # type: ignore[misc]
        self._head_bytes = 0
        self._head_timer: asyncio.TimerHandle | None = None
        if len(self.connections) > self.limits.connections:  # type: ignore[attr-defined]
            self._refuse(503, "Service Unavailable", f"the server holds its most open connections "
                         f"({self.limits.connections}, --max-connections); try again later", "too_many_connections")
            return
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)  # type: ignore[misc]

    def data_received(self, data: bytes) -> None:
        if self._awaiting_head():
            self._head_bytes += len(data)
        super().data_received(data)  # type: ignore[misc]
        if self.transport.get_protocol() is not self:  # type: ignore[attr-defined]
            self._cancel_head_timer()  # upgraded to a WebSocket, which has a protocol (and timeouts) of its own
            return
        if not self._awaiting_head():
            self._head_bytes = 0
            self._cancel_head_timer()
        elif self._head_bytes > self.limits.header_bytes and not self.transport.is_closing():  # type: ignore
            self._refuse(431, "Request Header Fields Too Large", f"the request head is over "
                         f"{self.limits.header_bytes} bytes (--max-header-bytes)", "header_too_large")

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        self._arm_head_timer()

    def _awaiting_head(self) -> bool:
        cycle = self.cycle  # type: ignore[attr-defined]
        return cycle is None or cycle.response_complete

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_bytes = 0
        self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_timed_out)  # type: ignore

    def _cancel_head_timer(self) -> None:
        if getattr(self, "_head_timer", None) is not None:
            self._head_timer.cancel()  # type: ignore[union-attr]
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._awaiting_head() and not self.transport.is_closing():  # type: ignore[attr-defined]
            self.transport.close()  # type: ignore[attr-defined]

    def _refuse(self, status: int, reason: str, message: str, code: str) -> None:
        self._cancel_head_timer()
        self.transport.write(_error_response(status, reason, message, code))  # type: ignore[attr-defined]
        self.transport.close()  # type: ignore[attr-defined]


def bounded_protocol(limits: ConnectionLimits, base: type = _DefaultProtocol) -> type:
    """uvicorn's HTTP protocol class (httptools where installed, as uvicorn's "auto" picks) under ``limits``."""
    return type(f"Bounded{base.__name__}", (_BoundedProtocol, base), {"limits": limits})


def uvicorn_settings(limits: ConnectionLimits) -> dict:
    """The `uvicorn.Config` arguments that carry ``limits``."""
    return {"http": bounded_protocol(limits), "timeout_keep_alive": limits.keep_alive_s,
            "h11_max_incomplete_event_size": limits.header_bytes}
