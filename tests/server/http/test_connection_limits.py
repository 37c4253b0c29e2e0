"""Connection limits (issue 41, items 2 and 5): an oversized request head gets 431 after at most the limit and one
read, a connection that trickles or sends nothing is closed after the head timeout, and beyond the connection cap a
new connection gets 503 at once. Before, uvicorn (httptools) buffered any header (a 256 MB one stalled every client
for minutes) and never closed a connection that had not sent a first request."""
from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from server.cli import build_parser, main
from server.http.connections import ConnectionLimits, uvicorn_settings
from tests.server.conftest import LiveServer

LIMITS = ConnectionLimits(header_bytes=16 * 1024, header_timeout_s=1.0, keep_alive_s=1.0, connections=8)


@contextmanager
def _plain_server(limits: ConnectionLimits) -> Iterator[tuple[str, int]]:
    """A trivial app behind uvicorn with ``limits``: the protocol's bounds alone, no model."""
    app = Starlette(routes=[Route("/health", lambda request: PlainTextResponse("ok"))])
    sock = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", **uvicorn_settings(limits)))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline
        time.sleep(0.02)
    try:
        yield sock.getsockname()[:2]
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="module")
def plain() -> Iterator[tuple[str, int]]:
    with _plain_server(LIMITS) as address:
        yield address


def _read_all(conn: socket.socket, timeout: float) -> bytes:
    conn.settimeout(timeout)
    out = b""
    try:
        while chunk := conn.recv(65536):
            out += chunk
    except (ConnectionResetError, socket.timeout):
        pass
    return out


def _send_huge_header(address: tuple[str, int], header_bytes: int) -> tuple[bytes, float]:
    """A GET whose one header is ``header_bytes`` long, sent until the server answers or cuts the connection."""
    started = time.monotonic()
    with socket.create_connection(address) as conn:
        conn.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: ")
        chunk = b"a" * 65536
        try:
            for _ in range(header_bytes // len(chunk)):
                conn.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass
        return _read_all(conn, 10), time.monotonic() - started


def _closed_within(conn: socket.socket, seconds: float) -> bool:
    """Whether the server closes ``conn`` (recv returns b"" or resets) within ``seconds``."""
    conn.settimeout(seconds)
    try:
        return conn.recv(1) == b""
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def test_an_oversized_head_gets_431_after_the_limit(plain: tuple[str, int]) -> None:
    reply, seconds = _send_huge_header(plain, 32 * 1024 * 1024)
    status, _, body = reply.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 431"), reply[:200]
    error = json.loads(body)["error"]
    assert error["code"] == "header_too_large" and "--max-header-bytes" in error["message"]
    assert seconds < 5
    assert httpx.get(f"http://{plain[0]}:{plain[1]}/health", timeout=10).text == "ok"


def test_a_head_within_the_limit_is_served(plain: tuple[str, int]) -> None:
    url = f"http://{plain[0]}:{plain[1]}/health"
    assert httpx.get(url, headers={"x-fine": "a" * 8000}, timeout=10).text == "ok"


def test_a_silent_connection_is_closed_after_the_head_timeout(plain: tuple[str, int]) -> None:
    with socket.create_connection(plain) as conn:
        assert _closed_within(conn, LIMITS.header_timeout_s + 3)


def test_a_trickling_head_is_closed_after_the_head_timeout(plain: tuple[str, int]) -> None:
    started = time.monotonic()
    with socket.create_connection(plain) as conn:
        conn.sendall(b"GET /health HTTP/1.1\r\n")
        try:
            for _ in range(40):  # a byte every 0.1 s: each read would restart uvicorn's own keep-alive timer
                conn.sendall(b"x")
                time.sleep(0.1)
        except (BrokenPipeError, ConnectionResetError):
            pass
        assert _closed_within(conn, 3)
    assert time.monotonic() - started < LIMITS.header_timeout_s + 3


def test_an_idle_keep_alive_connection_is_closed(plain: tuple[str, int]) -> None:
    with socket.create_connection(plain) as conn:
        conn.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        conn.settimeout(5)
        assert conn.recv(65536).startswith(b"HTTP/1.1 200")
        assert _closed_within(conn, LIMITS.keep_alive_s + 3)


def test_connections_beyond_the_cap_get_503_at_once() -> None:
    with _plain_server(LIMITS) as address, ExitStack() as stack:
        held = [stack.enter_context(socket.create_connection(address)) for _ in range(LIMITS.connections)]
        time.sleep(0.3)  # the server has accepted them all
        extra = stack.enter_context(socket.create_connection(address))
        reply = _read_all(extra, 5)
        assert reply.startswith(b"HTTP/1.1 503"), reply[:200]
        assert json.loads(reply.partition(b"\r\n\r\n")[2])["error"]["code"] == "too_many_connections"
        for conn in held:
            conn.close()
        time.sleep(0.3)
        assert httpx.get(f"http://{address[0]}:{address[1]}/health", timeout=10).text == "ok"


def test_the_served_app_has_the_default_limits_before_authentication(qwen_server: LiveServer) -> None:
    host, port = qwen_server.base_url.removeprefix("http://").split(":")
    reply, seconds = _send_huge_header((host, int(port)), 8 * 1024 * 1024)
    assert reply.startswith(b"HTTP/1.1 431") and seconds < 5
    assert httpx.get(f"{qwen_server.base_url}/health", timeout=10).status_code == 200


def test_each_connection_limit_has_a_flag() -> None:
    args = build_parser().parse_args(["serve", "--max-header-bytes", "1000", "--header-timeout", "2.5",
                                      "--keep-alive-timeout", "3", "--max-connections", "10"])
    assert (args.connection_header_bytes, args.connection_header_timeout_s, args.connection_keep_alive_s,
            args.connection_connections) == (1000, 2.5, 3.0, 10)
    assert build_parser().parse_args(["serve"]).connection_header_bytes == ConnectionLimits().header_bytes


@pytest.mark.parametrize("flag", ["--max-connections", "--max-header-bytes", "--max-sequences-per-tenant",
                                  "--max-stop-strings"])
def test_a_limit_out_of_range_is_refused_before_the_model_loads(flag: str, capsys) -> None:
    assert main(["serve", flag, "0", "--model", "no-such-model"]) == 2
    assert "must be positive" in capsys.readouterr().err
