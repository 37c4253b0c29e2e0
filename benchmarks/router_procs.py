"""kvserve replicas and real routers as local processes on 127.0.0.1, for `kvserve bench router` and its test.

A `Replica` is one `kvserve serve` process publishing KV events; a router is vLLM's (`vllm-router`, any policy),
SGLang's (`sglang-router`), or Dynamo's standalone KV indexer behind `DynamoIndexerRouter`, which picks the
replica with the longest indexed prefix as a router built on that indexer would. Every process logs to a file in
the run's log directory, and every one is stopped when its `with` block ends.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import ExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Process:
    """A child process logging to ``log``; `stop` ends it (SIGTERM, then SIGKILL), `kill` at once."""

    def __init__(self, name: str, argv: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.name, self.argv, self.log = name, argv, log
        self._env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, env=self._env,
                                         start_new_session=True)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_http(self, url: str, timeout: float) -> None:
        """Until GET ``url`` answers 200; fails with the log's tail if the process exits or time runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.running:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode if self.proc else '?'}):\n{self.tail()}")
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"{self.name} did not answer {url} within {timeout:.0f}s:\n{self.tail()}")

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:]) if self.log.exists() else ""

    def kill(self) -> None:
        if self.running:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.running:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()


@dataclass
class ReplicaConfig:
    model: str = "qwen3-tiny"
    block_size: int = 16
    num_kv_blocks: int = 4096
    max_model_len: int = 16384
    kv_events: bool = True


@dataclass
class Replica:
    """One `kvserve serve` on 127.0.0.1; its KV events on ``events_port`` (replay on ``replay_port``)."""

    index: int
    config: ReplicaConfig
    log_dir: Path
    port: int = field(default_factory=free_port)
    events_port: int = field(default_factory=free_port)
    replay_port: int = field(default_factory=free_port)
    process: Process | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def events_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.events_port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    def argv(self) -> list[str]:
        c = self.config
        argv = [sys.executable, "-m", "server.cli", "serve", "--model", c.model, "--host", "127.0.0.1",
                "--port", str(self.port), "--block-size", str(c.block_size), "--num-kv-blocks", str(c.num_kv_blocks),
                "--max-model-len", str(c.max_model_len), "--log-level", "warning"]
        if c.kv_events:
            # '*' binds (a bare address would be connected to, as vLLM does); routers connect on 127.0.0.1
            argv += ["--kv-events-endpoint", f"tcp://*:{self.events_port}",
                     "--kv-events-replay-endpoint", f"tcp://*:{self.replay_port}"]
        return argv

    def start(self) -> None:
        """Start the process (a restart keeps the ports); `wait_ready` waits for it."""
        self.process = Process(f"replica {self.index}", self.argv(), self.log_dir / f"replica{self.index}.log")
        self.process.start()

    def wait_ready(self, timeout: float = 300.0) -> None:
        self.process.wait_http(self.url + "/health", timeout)

    def warm_up(self) -> None:
        """One short request, so a run's first request does not pay the process's first forward; it shares no
        block with agent prompts."""
        body = {"model": self.config.model, "messages": [{"role": "user", "content": "warm up"}], "max_tokens": 1}
        httpx.post(self.url + "/v1/chat/completions", json=body, timeout=300).raise_for_status()

    def instance_id(self) -> str:
        return httpx.get(self.url + "/get_server_info", timeout=10).json()["instance_id"]

    def kill(self) -> None:
        self.process.kill()

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()


def start_replicas(stack: ExitStack, n: int, config: ReplicaConfig, log_dir: Path) -> list[Replica]:
    """``n`` replicas, loading side by side; each is stopped when ``stack`` closes."""
    replicas = [Replica(i, config, log_dir) for i in range(n)]
    for r in replicas:
        r.start()
        stack.callback(r.stop)
    for r in replicas:
        r.wait_ready()
        r.warm_up()
    return replicas


# ---- routers ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RouterSpec:
    """One routing policy of one router: what the benchmark table's row names."""

    name: str  # the row's label
    router: str  # vllm-router | sglang-router | dynamo-indexer
    policy: str
    signal: str  # what it routes by: none, request text, KV events
    extra_args: tuple[str, ...] = ()


class HttpRouter:
    """vLLM's or SGLang's router in front of the replicas: clients send every request to ``url``."""

    def __init__(self, spec: RouterSpec, replicas: list[Replica], log_dir: Path, instance: int = 0) -> None:
        self.spec, self.port = spec, free_port()
        module = {"vllm-router": "vllm_router.launch_router", "sglang-router": "sglang_router.launch_router"}
        argv = [sys.executable, "-m", module[spec.router], "--host", "127.0.0.1", "--port", str(self.port),
                "--worker-urls", *[r.url for r in replicas], "--policy", spec.policy,
                # a dead replica leaves the rotation within seconds, not after the default minute
                "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                "--log-level", "debug" if spec.router == "vllm-router" else "info", *spec.extra_args]
        self.process = Process(spec.name, argv, log_dir / f"router-{spec.name}-{instance}.log")
        self.url = f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.process.start()
        self.process.wait_http(self.url + "/health", 120)

    def stop(self) -> None:
        self.process.stop()

    @asynccontextmanager
    async def route(self, client: httpx.AsyncClient, body: dict[str, Any]) -> AsyncIterator[str]:
        """Where to send ``body``: the router itself, which picks the replica."""
        yield self.url


class DynamoIndexerRouter:
    """Dynamo's standalone KV indexer (ai-dynamo-runtime: `dynamo._core.run_kv_indexer`, no etcd or NATS) fed by
    every replica's KV events, and the few lines of routing a client of it adds: each request goes to the healthy
    replica with the longest indexed prefix of its token ids (rendered by a replica's
    /v1/chat/completions/render), ties to the one with the fewest requests in flight. Health is polled at most once
    a second, as the other routers here are configured to."""

    def __init__(self, spec: RouterSpec, replicas: list[Replica], log_dir: Path, block_size: int,
                 model: str, instance: int = 0) -> None:
        self.spec, self.replicas, self.model, self.port = spec, replicas, model, free_port()
        workers = ",".join(f"{r.index + 1}={r.events_endpoint}" for r in replicas)
        code = "import sys; from dynamo._core import run_kv_indexer; run_kv_indexer(sys.argv[1:])"
        argv = [sys.executable, "-c", code, "--port", str(self.port), "--block-size", str(block_size),
                "--model-name", model, "--workers", workers]
        self.process = Process(spec.name, argv, log_dir / f"router-{spec.name}-{instance}.log")
        self.url = f"http://127.0.0.1:{self.port}"
        self.in_flight = {r.index: 0 for r in replicas}
        self._healthy: list[Replica] = list(replicas)
        self._checked = 0.0

    def start(self) -> None:
        self.process.start()
        deadline = time.monotonic() + 60
        while True:  # it answers POST only: a query for nothing means it is up
            try:
                httpx.post(self.url + "/query", json={"model_name": self.model, "token_ids": [0]}, timeout=2)
                return
            except httpx.HTTPError:
                if not self.process.running or time.monotonic() > deadline:
                    raise RuntimeError(f"the Dynamo indexer did not start:\n{self.process.tail()}") from None
                time.sleep(0.25)

    def stop(self) -> None:
        self.process.stop()

    async def healthy(self, client: httpx.AsyncClient) -> list[Replica]:
        if time.monotonic() - self._checked > 1.0:
            self._checked = time.monotonic()
            ok = []
            for r in self.replicas:
                try:
                    if (await client.get(r.url + "/health", timeout=2)).status_code == 200:
                        ok.append(r)
                except httpx.HTTPError:
                    pass
            self._healthy = ok
        return self._healthy

    async def overlap(self, client: httpx.AsyncClient, body: dict[str, Any], via: Replica) -> dict[int, int]:
        """Indexed prefix length (tokens, device tier) per replica index."""
        rendered = await client.post(via.url + "/v1/chat/completions/render", json=body)
        scores = await client.post(self.url + "/query", json={"model_name": self.model,
                                                             "token_ids": rendered.json()["token_ids"]})
        instances = scores.json().get("instances", {})
        return {int(worker) - 1: info.get("gpu", 0) for worker, info in instances.items()}

    @asynccontextmanager
    async def route(self, client: httpx.AsyncClient, body: dict[str, Any]) -> AsyncIterator[str]:
        healthy = await self.healthy(client)
        if not healthy:
            raise RuntimeError("no healthy replica")
        matched = await self.overlap(client, body, healthy[0])
        best = max(healthy, key=lambda r: (matched.get(r.index, 0), -self.in_flight[r.index]))
        self.in_flight[best.index] += 1
        try:
            yield best.url
        finally:
            self.in_flight[best.index] -= 1


def start_router(stack: ExitStack, spec: RouterSpec, replicas: list[Replica], config: ReplicaConfig,
                 log_dir: Path, instance: int = 0) -> HttpRouter | DynamoIndexerRouter:
    router = (DynamoIndexerRouter(spec, replicas, log_dir, config.block_size, config.model, instance)
              if spec.router == "dynamo-indexer" else HttpRouter(spec, replicas, log_dir, instance))
    router.start()
    stack.callback(router.stop)
    return router


class Alternating:
    """Several instances of one router behind a client-side load balancer, as routers are run for availability:
    requests alternate between them, so each instance sees every other request of a session."""

    def __init__(self, routers: list[HttpRouter | DynamoIndexerRouter]) -> None:
        self.routers = routers
        self._next = 0

    @asynccontextmanager
    async def route(self, client: httpx.AsyncClient, body: dict[str, Any]) -> AsyncIterator[str]:
        router = self.routers[self._next % len(self.routers)]
        self._next += 1
        async with router.route(client, body) as url:
            yield url
