"""Real uvicorn servers on 127.0.0.1 (one per model, for the whole session) and helpers to look inside them."""
from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import anthropic
import httpx
import openai
import pytest

from engine.config import EngineConfig
from engine.core.loop import EngineLoop
from engine.outputs import SchedulerStats
from engine.core.engine import LLMEngine
from server.http.app import create_app
from server.pipeline.context import ServerSettings, ServingContext, load_context
from server.http.graceful import GracefulServer
from server.http.limits import RequestLimits

T = TypeVar("T")
KEY_A, KEY_B = "sk-tenant-a", "sk-tenant-b"


@dataclass
class LiveServer:
    ctx: ServingContext
    base_url: str  # http://127.0.0.1:PORT
    record_path: Path | None = None
    api_key: str = "unused"

    def client(self, api_key: str | None = None, **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=api_key or self.api_key, max_retries=0,
                             timeout=120, **kwargs)

    def chat(self, api_key: str | None = None, **kwargs: Any) -> Any:
        """`chat.completions.create` with this server's model filled in."""
        return self.client(api_key).chat.completions.create(model=self.ctx.model_name, **kwargs)

    def anthropic(self, api_key: str | None = None, **kwargs: Any) -> anthropic.Anthropic:
        """The official Anthropic client; it sends the key as `x-api-key`."""
        return anthropic.Anthropic(base_url=self.base_url, api_key=api_key or self.api_key, max_retries=0,
                                   timeout=120, **kwargs)

    def last_record(self) -> dict[str, Any]:
        """The `--record` line of the last finished request."""
        return json.loads(self.record_path.read_text().splitlines()[-1])

    def async_client(self, api_key: str | None = None) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key=api_key or self.api_key, max_retries=0,
                                  timeout=120)

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=120,
                            headers={"Authorization": f"Bearer {self.api_key}"})

    def in_engine(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn` on the engine thread between steps: a consistent view of the engine's state (a thread core
        only: the core in a process of its own answers its named queries alone)."""
        core = self.ctx.engine.core
        assert isinstance(core, EngineLoop), "looking inside the engine needs the in-process core"
        return core.call(fn).result(timeout=60)

    def stats(self) -> SchedulerStats:
        """The engine's counters now (a named query: either core answers it)."""
        return self.ctx.engine.core.stats().result(timeout=60)

    def reset_prefix_cache(self) -> None:
        self.ctx.engine.core.reset_prefix_cache().result(timeout=60)

    def metrics(self) -> dict[str, float]:
        """`/metrics` as {name{labels}: value}, comments dropped."""
        text = httpx.get(f"{self.base_url}/metrics", timeout=30).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def metric(self, name: str) -> float:
        label = f'model="{self.ctx.model_name}"'
        return self.metrics()[f"{name}{{{label}}}"]

    def wait_until_idle(self, timeout: float = 30.0) -> None:
        """Aborts reach the engine through its command queue; wait until it holds no sequence at all."""
        deadline = time.monotonic() + timeout
        while (stats := self.stats()).requests_running or stats.requests_waiting:
            assert time.monotonic() < deadline, "the engine still holds sequences"
            time.sleep(0.05)


@contextmanager
def serve(ctx: ServingContext) -> Iterator[str]:
    sock = socket.create_server(("127.0.0.1", 0))
    server = GracefulServer(create_app(ctx), log_level="warning", timeout_graceful_shutdown=5)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        assert not ctx.engine.alive, "the engine thread outlived the server"


def _live_server(factory: pytest.TempPathFactory, model: str, engine: EngineConfig,
                 settings: ServerSettings = ServerSettings(), api_key: str = "unused",
                 engine_process: bool = False) -> Iterator[LiveServer]:
    """Serve ``model`` on 127.0.0.1 for the session, recording every request body (``engine_process``: the engine
    core in a process of its own)."""
    record = factory.mktemp("record") / "requests.jsonl"
    ctx = load_context(model, engine, settings, record_path=str(record), engine_process=engine_process)
    with serve(ctx) as url:
        yield LiveServer(ctx, url, record, api_key=api_key)


@pytest.fixture(scope="session")
def qwen_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """qwen3-tiny (random weights, the real Qwen3 tokenizer and template): fast, so most tests use it. Two tenants
    (API keys); a short context so that the max_tokens clamp is cheap to reach."""
    yield from _live_server(
        tmp_path_factory, "qwen3-tiny",
        EngineConfig(block_size=4, num_kv_blocks=2048, max_num_seqs=64, max_model_len=512),
        ServerSettings(api_keys=(KEY_A, KEY_B), max_n=4, limits=RequestLimits(body_bytes=256 * 1024)), api_key=KEY_A,
    )


@pytest.fixture(scope="session")
def smol_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """smollm2-135m: real weights and its own Jinja chat template; no API keys."""
    yield from _live_server(tmp_path_factory, "smollm2-135m",
                            EngineConfig(block_size=16, num_kv_blocks=256, max_model_len=2048))


@pytest.fixture(scope="session")
def deepseek_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """deepseek-tiny (the DeepSeek-V3.1 template: with thinking on, the output starts inside reasoning)."""
    yield from _live_server(tmp_path_factory, "deepseek-tiny",
                            EngineConfig(block_size=4, num_kv_blocks=1024, max_model_len=512))


@pytest.fixture(scope="session")
def qwen36_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A local model directory with the real Qwen3.5/3.6 tokenizer and the official Qwen3.6-27B template on a tiny
    Qwen3-architecture model (random weights): the `qwen3.6` family end to end, found by its template like any local
    checkpoint. The hybrid architecture's own `qwen3.6-tiny` is built elsewhere (issue 21)."""
    from engine.model_sources.tiny import TinyRecipe, build_tiny_model

    out = tmp_path_factory.mktemp("qwen36-template-tiny")
    recipe = TinyRecipe(model_type="qwen3", tokenizer="qwen3.6", seed=36, vocab_size=248_320,
                        max_position_embeddings=262_144)
    build_tiny_model(recipe, "qwen3.6", out)
    return out


@pytest.fixture(params=["qwen", "smol"])
def any_server(request: pytest.FixtureRequest) -> LiveServer:
    return request.getfixturevalue(f"{request.param}_server")


@pytest.fixture(scope="session")
def hybrid_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """qwen3.6-tiny: the hybrid architecture (Gated DeltaNet + gated attention), whose prefix hits need recurrent-state
    snapshots (docs/HYBRID_CACHE.md), with the real Qwen3.6 tokenizer and template."""
    yield from _live_server(tmp_path_factory, "qwen3.6-tiny",
                            EngineConfig(block_size=4, num_kv_blocks=1024, max_model_len=2048, num_state_snapshots=32))
