"""The walk of one request through the server's modules, as the interpreter runs it: which files it visits, in what
order, and how often control comes back to a file it left (issue 36's measure of a house a newcomer can follow).

    python -m tests.request_walk                 # a /v1/messages request with a tool, against qwen3-tiny
    python -m tests.request_walk --endpoint chat # /v1/chat/completions

Every call and return in a `server/` module, on any thread (the event loop's and the prepare lane's), is traced; a
*stay* is a run of consecutive events in one file, a *return* a stay in a file the walk had already left. Printed:
the stays in order (file, events), then per file its stays, then the totals.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import threading
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SERVER = str(ROOT / "server") + "/"
BODIES = {
    "messages": ("/v1/messages", {
        "model": "qwen3-tiny", "max_tokens": 8, "system": "You are a coding agent.",
        "tools": [{"name": "read_file", "description": "Read a file", "input_schema": {
            "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}],
        "messages": [{"role": "user", "content": "Why does main.py crash on start?"}]}),
    "chat": ("/v1/chat/completions", {
        "model": "qwen3-tiny", "max_tokens": 8,
        "messages": [{"role": "user", "content": "Why does main.py crash on start?"}]}),
}


class Walk:
    """The files of `server/` that trace events land in, one entry per stay, while recording."""

    def __init__(self) -> None:
        self.stays: list[list[Any]] = []  # [file, events]
        self.lock = threading.Lock()
        self.recording = False

    def profile(self, frame: FrameType, event: str, arg: Any) -> None:
        path = frame.f_code.co_filename
        if not self.recording or event not in ("call", "return") or not path.startswith(SERVER):
            return
        name = path[len(str(ROOT)) + 1:]
        with self.lock:
            if self.stays and self.stays[-1][0] == name:
                self.stays[-1][1] += 1
            else:
                self.stays.append([name, 1])


def run(endpoint: str) -> Walk:
    import httpx

    from engine.config import EngineConfig
    from server.http.app import create_app
    from server.pipeline.context import ServerSettings, load_context

    walk = Walk()
    threading.setprofile(walk.profile)  # before any thread of the server starts (the prepare lane's included)
    ctx = load_context("qwen3-tiny", EngineConfig(block_size=4, max_model_len=2048), ServerSettings())
    app = create_app(ctx)
    path, body = BODIES[endpoint]

    async def request(record: bool) -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://kvserve") as client:
            sys.setprofile(walk.profile)
            walk.recording = record
            try:
                response = await client.post(path, json=body)
            finally:
                walk.recording = False
                sys.setprofile(None)
            response.raise_for_status()

    async def main() -> Walk:
        async with app.router.lifespan_context(app):
            await request(False)  # warm: first-use imports and compiles are not the request's walk
            await request(True)
            return walk

    return asyncio.run(main())


def report(walk: Walk) -> str:
    seen: set[str] = set()
    returns = 0
    lines = ["stays, in order (file: trace events):"]
    for name, events in walk.stays:
        returns += name in seen
        seen.add(name)
        lines.append(f"  {name}: {events}")
    per_file = Counter(name for name, _ in walk.stays)
    lines.append("stays per file:")
    lines += [f"  {count:3d}  {name}" for name, count in per_file.most_common()]
    lines.append(f"{len(walk.stays)} stays in {len(per_file)} files, {returns} returns to a file already left")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--endpoint", choices=sorted(BODIES), default="messages")
    args = parser.parse_args()
    print(report(run(args.endpoint)))


if __name__ == "__main__":
    main()
