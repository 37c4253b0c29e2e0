"""``kvserve bench hostile``: one request never hurts another, measured. A `kvserve serve` process with two tenants
(API keys); bystander streams of tenant B are running when each hostile input of issues 22 and 41
(benchmarks/hostile_round2.py) is sent by tenant A, and a newcomer (a small request of tenant B) arrives just after
it. For each input: its status (a 5xx, or a string naming a leak or a failure, counts as a failure) and time, every
bystander's worst wait for its next token and the newcomer's whole time, each against its own baseline measured in
the same run with nothing hostile going on, and the server's memory afterwards. The goal: no bystander waits more
than 1 s longer than its baseline, for any input.

The baseline is measured twice (first and last) under the same protocol, and the worse of the two counts: the
machine is shared, and a quiet baseline would charge its neighbours' load to the inputs.
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks.hostile_round2 import SERVER_ARGS as ROUND2_SERVER_ARGS
from benchmarks.hostile_round2 import KEY_BYSTANDER, KEY_HOSTILE, round2_inputs
from benchmarks.router_procs import Process, free_port

GOAL_S = 1.0


@dataclass
class Hostile:
    """One hostile input: ``send(url, headers)`` returns its HTTP status (or raises when the client gives up)."""

    name: str
    send: Callable[[str, dict], int]


def _post(body: Any = None, raw: bytes | None = None, path: str = "/v1/chat/completions", timeout: float = 600.0,
          ) -> Callable[[str, dict], int]:
    def send(url: str, headers: dict) -> int:
        content = raw if raw is not None else json.dumps(body).encode()
        response = httpx.post(url + path, content=content, timeout=timeout,
                              headers={**headers, "Content-Type": "application/json"})
        return response.status_code
    return send


def _disconnect_while_compiling(url: str, headers: dict) -> int:
    """A slow grammar's client that leaves after a second: the compile must stop with it."""
    body = {"messages": HI, "max_tokens": 2, "response_format": _schema(_slow_string(min_length=130))}
    try:
        httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=1.0)
    except httpx.TimeoutException:
        return 499
    return 0


def _stored_response_of_another_tenant(url: str, headers: dict) -> int:
    """Tenant B stores a response; tenant A (the hostile one) tries to continue it."""
    mine = httpx.post(url + "/v1/responses", headers={"Authorization": f"Bearer {KEY_BYSTANDER}"}, timeout=120,
                      json={"input": "my secret is 1234", "max_output_tokens": 2, "store": True}).json()["id"]
    return httpx.post(url + "/v1/responses", headers=headers, timeout=120,
                      json={"input": "what was it?", "max_output_tokens": 2, "previous_response_id": mine}).status_code


HI = [{"role": "user", "content": "hi"}]


def _schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


def _enum(n: int) -> dict:
    return {"type": "string", "enum": [f"value number {i}" for i in range(n)]}


def _slow_string(min_length: int = 120) -> dict:
    """Within every limit, yet a compile of seconds: a string of at least 120 characters (a long regex repetition)."""
    return {"type": "object", "properties": {"q": {"type": "string", "minLength": min_length}}, "required": ["q"]}


def _nested_schema(depth: int) -> str:
    return '{"type": "object", "properties": {"a": ' * depth + '{"type": "string"}' + "}}" * depth


def hostile_inputs() -> list[Hostile]:
    """The inputs of issue 22 that a request can carry, two more that are legal but heavy, and issue 41's."""
    deep_tool = ('{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tool_choice": "required", '
                 '"tools": [{"type": "function", "function": {"name": "f", "parameters": %s}}]}' % _nested_schema(500))
    return [
        Hostile("seed 2^64", _post({"messages": HI, "max_tokens": 4, "seed": 2**64})),
        Hostile("enum of 100,000 strings", _post({"messages": HI, "max_tokens": 2, "response_format":
                                                  _schema(_enum(100_000))})),
        Hostile("enum of 10,000 strings", _post({"messages": HI, "max_tokens": 2, "response_format":
                                                 _schema(_enum(10_000))})),
        Hostile("EBNF of 50,000 alternatives", _post({"messages": HI, "max_tokens": 2, "structured_outputs": {
            "grammar": "root ::= " + " | ".join(f'"w{i}"' for i in range(50_000))}})),
        Hostile("20 MB body", _post({"messages": [{"role": "user", "content": "x " * 10_000_000}], "max_tokens": 2})),
        Hostile("7 MB body (under the limit)", _post({"messages": [{"role": "user", "content": "word " * 1_400_000}],
                                                      "max_tokens": 2})),
        Hostile("50,000 messages", _post({"messages": HI * 50_000, "max_tokens": 2})),
        Hostile("lone surrogate", _post(raw=b'{"messages": [{"role": "user", "content": "x\\ud800"}], "max_tokens": 2}')),
        Hostile("JSON nested 100,000 deep", _post(raw=b"[" * 100_000 + b"]" * 100_000)),
        Hostile("tool schema nested 500 deep", _post(raw=deep_tool.encode())),
        Hostile("template kwargs naming the renderer's arguments", _post({"messages": HI, "max_tokens": 2,
                                                                          "chat_template_kwargs": {"messages": []}})),
        Hostile("another tenant's stored response", _stored_response_of_another_tenant),
        Hostile("slow grammar within the limits", _post({"messages": HI, "max_tokens": 2, "response_format":
                                                         _schema(_slow_string())})),
        Hostile("client leaving while its grammar compiles", _disconnect_while_compiling),
        *round2_inputs(Hostile),
    ]


@dataclass
class Bystander:
    """A streaming request of tenant B: the worst wait for its next token while it runs (its first token's included)."""

    index: int
    url: str
    max_tokens: int
    worst_wait_s: float = 0.0
    tokens: int = 0
    error: str | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _first: threading.Event = field(default_factory=threading.Event)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        if not self._first.wait(300):
            raise RuntimeError(f"bystander {self.index} got no token")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)

    def _run(self) -> None:
        body = {"messages": [{"role": "user", "content": f"bystander {self.index}: tell me a long story"}],
                "max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
        last = time.monotonic()
        try:
            with httpx.stream("POST", self.url + "/v1/chat/completions", json=body, timeout=600,
                              headers={"Authorization": f"Bearer {KEY_BYSTANDER}"}) as response:
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    now = time.monotonic()
                    self.worst_wait_s, last = max(self.worst_wait_s, now - last), now
                    self.tokens += 1
                    if "error" in json.loads(line[6:]):  # the stream's own error event
                        self.error = line[6:200]
                    self._first.set()
                    if self._stop.is_set():
                        return
        except httpx.HTTPError as exc:
            self.error = repr(exc)
        self._first.set()


def _memory_mib(pid: int) -> tuple[float, float]:
    """Resident memory of the server process, and of it with its children (the grammar compile workers)."""
    def rss(p: int) -> float:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            pass
        return 0.0

    children = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        children += [int(c) for c in task.read_text().split()]
    return rss(pid), rss(pid) + sum(rss(c) for c in children)


def _newcomer(url: str) -> float:
    """A small request arriving while the input is handled: its whole time (it must be prepared, unlike the
    bystanders, so it would wait behind a large preparation on a shared thread)."""
    started = time.monotonic()
    httpx.post(url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY_BYSTANDER}"}, timeout=600,
               json={"messages": [{"role": "user", "content": "newcomer"}], "max_tokens": 2}).raise_for_status()
    return time.monotonic() - started


def _round(url: str, bystanders: int, max_tokens: int, action: Callable[[], int], settle_s: float) -> dict[str, Any]:
    """Bystanders streaming, then ``action`` (the hostile input, or a quiet wait for the baseline) with a newcomer
    0.2 s after it starts, then ``settle_s`` more seconds of the streams. Waits count from the action's start."""
    streams = [Bystander(i, url, max_tokens) for i in range(bystanders)]
    for b in streams:
        b.start()
    outcome: dict[str, Any] = {}

    def act() -> None:
        started = time.monotonic()
        try:
            outcome["status"] = action()
        except Exception as exc:  # noqa: BLE001 - reported as the input's outcome
            outcome["status"] = repr(exc)
        outcome["seconds"] = time.monotonic() - started

    for b in streams:
        b.worst_wait_s = 0.0
    hostile = threading.Thread(target=act, daemon=True)
    hostile.start()
    time.sleep(0.2)
    newcomer_s = _newcomer(url)
    hostile.join()
    time.sleep(settle_s)
    for b in streams:
        b.stop()
    return {**outcome, "newcomer_s": newcomer_s, "worst_wait_s": [b.worst_wait_s for b in streams],
            "tokens": [b.tokens for b in streams], "errors": [b.error for b in streams if b.error]}


@dataclass
class HostileOptions:
    model: str = "qwen3-tiny"
    bystanders: int = 2
    max_tokens: int = 100_000  # bystanders are stopped when a round ends, long before
    quiet_s: float = 3.0  # the baseline round's "input": a wait this long
    settle_s: float = 0.5
    only: list[str] = field(default_factory=list)  # input names (substrings); empty: all
    log_dir: Path = Path("results/hostile")


def run_hostile_bench(opts: HostileOptions) -> dict[str, Any]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "server.cli", "serve", "--model", opts.model, "--port", str(port), "--block-size", "16",
            "--num-kv-blocks", "8192", "--max-model-len", "131072", "--api-key", KEY_HOSTILE, "--api-key",
            KEY_BYSTANDER, "--log-level", "warning", *ROUND2_SERVER_ARGS]
    inputs = [h for h in hostile_inputs() if not opts.only or any(o in h.name for o in opts.only)]
    rows: list[dict[str, Any]] = []
    with ExitStack() as stack:
        server = Process("server", argv, opts.log_dir / "server.log")
        server.start()
        stack.callback(server.stop)
        server.wait_http(url + "/health", 300)
        quiet = lambda: time.sleep(opts.quiet_s) or 0  # noqa: E731
        headers = {"Authorization": f"Bearer {KEY_HOSTILE}"}
        first = _round(url, opts.bystanders, opts.max_tokens, quiet, opts.settle_s)
        for hostile in inputs:
            print(f"hostile: {hostile.name} ...", flush=True)
            row = _round(url, opts.bystanders, opts.max_tokens, lambda h=hostile: h.send(url, headers),
                         opts.settle_s)
            row["input"] = hostile.name
            row["rss_mib"], row["rss_with_workers_mib"] = _memory_mib(server.proc.pid)
            row["healthy"] = httpx.get(url + "/health", timeout=30).status_code == 200
            rows.append(row)
        last = _round(url, opts.bystanders, opts.max_tokens, quiet, opts.settle_s)
    baseline = [max(a, b) for a, b in zip(first["worst_wait_s"], last["worst_wait_s"])]
    newcomer_baseline = max(first["newcomer_s"], last["newcomer_s"])
    for row in rows:
        row["over_baseline_s"] = [w - b for w, b in zip(row["worst_wait_s"], baseline)]
        row["newcomer_over_baseline_s"] = row["newcomer_s"] - newcomer_baseline
    worst = max((max(r["over_baseline_s"]) for r in rows), default=0.0)
    failed = [r["input"] for r in rows if not isinstance(r["status"], int) or r["status"] >= 500]
    return {"baseline_worst_wait_s": baseline, "newcomer_baseline_s": newcomer_baseline,
            "baseline_rounds": [first, last], "inputs": rows, "failed_inputs": failed,
            "worst_over_baseline_s": worst, "goal_s": GOAL_S, "goal_met": worst <= GOAL_S and not failed,
            "all_healthy": all(r["healthy"] for r in rows), "bystander_errors": sum(len(r["errors"]) for r in rows)}


def markdown(figures: dict[str, Any]) -> str:
    baseline = " / ".join(f"{b:.2f}" for b in figures["baseline_worst_wait_s"])
    lines = [f"Baseline (no hostile input): bystanders' worst wait for a token {baseline} s, newcomer "
             f"{figures['newcomer_baseline_s']:.2f} s", "",
             "| hostile input | status | its time (s) | bystanders' worst wait (s) | over baseline (s) | newcomer (s) "
             "| over baseline (s) | server RSS (MiB) | with compile workers (MiB) |",
             "|---|---|---:|---|---|---:|---:|---:|---:|"]
    for r in figures["inputs"]:
        waits = " / ".join(f"{w:.2f}" for w in r["worst_wait_s"])
        over = " / ".join(f"{w:+.2f}" for w in r["over_baseline_s"])
        lines.append(f"| {r['input']} | {r['status']} | {r['seconds']:.1f} | {waits} | {over} | "
                     f"{r['newcomer_s']:.2f} | {r['newcomer_over_baseline_s']:+.2f} | {r['rss_mib']:.0f} | "
                     f"{r['rss_with_workers_mib']:.0f} |")
    lines += ["", f"Worst over baseline: {figures['worst_over_baseline_s']:+.2f} s (goal: at most {GOAL_S:g} s; "
              f"{'met' if figures['goal_met'] else 'NOT met'}); inputs answered 5xx or failed: "
              f"{', '.join(figures['failed_inputs']) or 'none'}; server healthy after every input: "
              f"{figures['all_healthy']}; bystander streams that failed: {figures['bystander_errors']}"]
    return "\n".join(lines)


def configure(parser: argparse.ArgumentParser) -> None:
    d = HostileOptions()
    parser.add_argument("--model", default=d.model, help="registry model to serve")
    parser.add_argument("--bystanders", type=int, default=d.bystanders, help="streams of the other tenant")
    parser.add_argument("--quiet-s", type=float, default=d.quiet_s, help="length of a baseline round")
    parser.add_argument("--only", action="append", default=[], metavar="NAME",
                        help="run only the inputs whose name contains NAME (repeatable)")


def run(args: argparse.Namespace) -> dict:
    out_dir = Path(args.out_dir)
    figures = run_hostile_bench(HostileOptions(model=args.model, bystanders=args.bystanders, quiet_s=args.quiet_s,
                                               only=args.only, log_dir=out_dir))
    table = markdown(figures)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "hostile.md").write_text(table + "\n")
    print(table)
    return figures
