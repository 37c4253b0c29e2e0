"""Real agent clients sending images to a real `kvserve serve --model qwen3.6-tiny` (its vision tower loaded) on
127.0.0.1: Codex attaches a PNG with ``codex exec -i``, and its turn completes with the image's tokens in the
prompt it reports; Claude Code reads a PNG with its Read tool in a tool loop (the model's one call scripted by a
proxy, `FirstCallScripted`: a random model calls no tool) and completes the turn after kvserve read the picture in
the tool_result. qwen3.6-tiny's replies are noise, capped at 16 tokens as in the other client tests. Slow tier."""
from __future__ import annotations

import copy
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from tests.clients.harness import CODEX_CONFIG, installed_bins, run_client, serve
from tests.clients.sessions import codex_usage
from tests.models.checkpoints.vision_models import png

pytestmark = pytest.mark.slow

MODEL = "qwen3.6-tiny"
IMAGE_TOKENS = 64  # a 256 x 256 picture: 16 x 16 patches, 8 x 8 after the 2 x 2 merge (the tiny model's largest)


@pytest.fixture(scope="module")
def bins() -> Path:
    return installed_bins()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with serve(MODEL, tmp_path_factory.mktemp("serve") / "serve.log") as url:
        yield url


def test_codex_attaches_an_image(bins: Path, server: str, tmp_path: Path) -> None:
    """The same question with and without ``-i shot.png``: both turns complete, and the one with the picture reads
    the image's tokens more (input_image in /v1/responses, expanded to its 64 placeholder tokens)."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "shot.png").write_bytes(png(256, 256, seed=7))
    (tmp_path / ".codex").mkdir()
    (tmp_path / ".codex" / "config.toml").write_text(CODEX_CONFIG.format(url=server, model=MODEL))
    env = {"KVSERVE_API_KEY": "unused"}
    command = [str(bins / "codex"), "exec", "--json", "--skip-git-repo-check"]
    text = codex_usage(run_client([*command, "What does the screenshot show?"], tmp_path, env))
    image = codex_usage(run_client([*command, "What does the screenshot show?", "-i", "shot.png"], tmp_path, env))
    assert image["input_tokens"] - text["input_tokens"] >= IMAGE_TOKENS, (text, image)


class FirstCallScripted:
    """A proxy in front of the server that answers the first Claude Code request offering the Read tool with a
    Read call of ``path`` (as a model would stream it), and forwards every other request as it is. A tiny random
    model never calls a tool on its own; the image then travels as it does with a real model: Claude Code reads
    the PNG and sends it back as an image block inside the tool_result, which kvserve answers. ``forwarded``: the
    bodies of the /v1/messages requests it forwarded, with their status."""

    def __init__(self, upstream: str, path: Path) -> None:
        self.upstream, self.path = upstream, path
        self.forwarded: list[tuple[dict, int]] = []
        self.scripted = False
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                self._forward(None)

            def do_HEAD(self) -> None:
                self._forward(None)

            def do_POST(self) -> None:
                self._forward(self.rfile.read(int(self.headers.get("content-length", 0))))

            def _forward(self, raw: bytes | None) -> None:
                body = json.loads(raw) if raw and self.path.startswith("/v1/messages") else None
                if body is not None and not proxy.scripted and _offers_read(body):
                    proxy.scripted = True
                    return self._reply(200, "text/event-stream", _read_call_events(str(proxy.path)))
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length")}
                response = httpx.request(self.command, proxy.upstream + self.path, content=raw, headers=headers,
                                         timeout=400)
                if body is not None and self.path.split("?")[0] == "/v1/messages":
                    proxy.forwarded.append((body, response.status_code))
                self._reply(response.status_code, response.headers.get("content-type", "application/json"),
                            response.content)

            def _reply(self, status: int, content_type: str, content: bytes) -> None:
                self.send_response(status)
                self.send_header("content-type", content_type)
                self.send_header("content-length", str(len(content)))
                self.end_headers()
                self.wfile.write(content)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "FirstCallScripted":
        self.thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.server.shutdown()
        self.server.server_close()


def _offers_read(body: dict) -> bool:
    """A main-loop request (the Read tool offered) with no tool result yet."""
    results = [b for m in body.get("messages", []) if isinstance(m.get("content"), list)
               for b in m["content"] if isinstance(b, dict) and b.get("type") == "tool_result"]
    return any(t.get("name") == "Read" for t in body.get("tools") or []) and not results


def _read_call_events(path: str) -> bytes:
    """Anthropic Messages streaming events of one assistant message: a Read call of ``path``."""
    events = [
        ("message_start", {"type": "message_start", "message": {
            "id": "msg_scripted", "type": "message", "role": "assistant", "model": MODEL, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 1}}}),
        ("content_block_start", {"type": "content_block_start", "index": 0, "content_block": {
            "type": "tool_use", "id": "toolu_scripted", "name": "Read", "input": {}}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": {
            "type": "input_json_delta", "partial_json": json.dumps({"file_path": path})}}),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                           "usage": {"output_tokens": 12}}),
        ("message_stop", {"type": "message_stop"}),
    ]
    return "".join(f"event: {name}\ndata: {json.dumps(data)}\n\n" for name, data in events).encode()


def _tool_results(body: dict) -> list[dict]:
    """The tool_result blocks whose content is a list of blocks."""
    return [b for m in body["messages"] if isinstance(m.get("content"), list) for b in m["content"]
            if b.get("type") == "tool_result" and isinstance(b.get("content"), list)]


def _tool_result_images(body: dict) -> list[dict]:
    return [part for b in _tool_results(body) for part in b["content"] if part.get("type") == "image"]


def test_claude_code_reads_a_png_in_a_tool_loop(bins: Path, server: str, tmp_path: Path) -> None:
    """Claude Code's Read tool returns the PNG as an image block inside the tool_result; kvserve reads it (the
    request's count_tokens is the image's 64 tokens more than without it) and answers, and the turn completes."""
    shot = tmp_path / "project" / "shot.png"
    shot.parent.mkdir(parents=True)
    shot.write_bytes(png(256, 256, seed=8))
    with FirstCallScripted(server, shot) as proxy:
        env = {"ANTHROPIC_BASE_URL": proxy.url, "ANTHROPIC_API_KEY": "unused"}
        out = json.loads(run_client([str(bins / "claude"), "--model", MODEL, "--output-format", "json",
                                     "--allowedTools", "Read", "-p", "What does shot.png show?"], tmp_path, env))
    assert proxy.scripted and out["is_error"] is False and out["subtype"] == "success", out
    with_image = [(body, status) for body, status in proxy.forwarded if _tool_result_images(body)]
    assert with_image and all(status == 200 for _, status in with_image), proxy.forwarded
    body = {k: v for k, v in with_image[0][0].items() if k in ("model", "messages", "system", "tools")}
    without = copy.deepcopy(body)
    for block in _tool_results(without):
        block["content"] = [p for p in block["content"] if p.get("type") != "image"] or "x"
    counts = [httpx.post(server + "/v1/messages/count_tokens", json=b, timeout=60).json()["input_tokens"]
              for b in (body, without)]
    assert counts[0] - counts[1] >= IMAGE_TOKENS, counts
