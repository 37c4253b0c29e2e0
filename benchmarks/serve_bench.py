"""What serving over HTTP costs: N concurrent streaming clients against `kvserve serve`, side by side with the
offline `LLM.generate` on the same requests, in one run.

The server runs as `kvserve serve` in a child process with the same engine settings as the offline engine. The
requests are chat completions (or text completions with ``--api completions``) of short random-word messages;
their prompt token ids come from the server's own `/tokenize`, so the offline engine runs exactly the prompts the
server renders. Every request decodes exactly ``--max-tokens`` tokens (``ignore_eos``, greedy), so both sides do the
same model work, and the difference is the server's per-token work: the hand-off from the engine thread, detokenizing,
parsing, JSON and SSE framing, HTTP. On a model whose forward is nearly free (qwen3-tiny) that work is what is
measured. The clients are deliberately lean (raw sockets; the streams are parsed only after the clock stops), so the
client process takes as little CPU from the server as it can; the streamed texts are then checked against the offline
texts. The two sides take turns ``--repeats`` times and each side's fastest run counts. Beside the wall-clock ratio,
each side's CPU time per output token (the offline process's; the whole server process's, engine thread included):
on a machine shared with other work the ratio drifts with the load, the CPU time much less.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks.prefix.report import markdown_table
from benchmarks.router_procs import Process, free_port

WORDS = ("cache", "block", "token", "agent", "prompt", "stream", "kernel", "page", "radix", "tool", "model", "batch")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="qwen3-tiny", help="registry model (default: qwen3-tiny)")
    parser.add_argument("--streams", type=int, default=256, help="concurrent streaming requests (default: 256)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens each request decodes (default: 64)")
    parser.add_argument("--prompt-words", type=int, default=12, help="random words per user message (default: 12)")
    parser.add_argument("--api", choices=("chat", "completions"), default="chat",
                        help="/v1/chat/completions (rendering, reasoning and tool-call parsing) or /v1/completions")
    parser.add_argument("--repeats", type=int, default=2, help="runs per side; the fastest counts (default: 2)")
    parser.add_argument("--torch-threads", type=int, default=None,
                        help="torch's intra-op threads on both sides (default: torch's own choice, the cores)")
    parser.add_argument("--engine-process", choices=("on", "off"), default="on",
                        help="the server's engine core in a process of its own or in a thread (kvserve serve's flag "
                        "and default) (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)


@dataclass(frozen=True)
class _PreparedRequest:
    body: dict
    prompt_token_ids: list[int]


@dataclass
class _RawStream:
    """One client's raw response (HTTP/1.1, chunked), read without parsing while the clock runs."""

    raw: bytearray
    first_byte_s: float = 0.0
    end_s: float = 0.0


def _engine_flags(args: argparse.Namespace) -> dict[str, int]:
    blocks_per_seq = -(-(64 + args.prompt_words * 4 + args.max_tokens) // 16) + 1
    return {"max_num_seqs": args.streams, "block_size": 16, "num_kv_blocks": args.streams * blocks_per_seq + 64,
            "max_model_len": 4096}


def _bodies(args: argparse.Namespace, model: str) -> list[dict]:
    rng = random.Random(args.seed)
    bodies = []
    for _ in range(args.streams):
        text = " ".join(rng.choice(WORDS) for _ in range(args.prompt_words))
        body = {"model": model, "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        if args.api == "chat":
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        bodies.append(body)
    return bodies


def _with_prompt_ids(url: str, bodies: list[dict]) -> list[_PreparedRequest]:
    requests = []
    with httpx.Client(base_url=url, timeout=60) as client:
        for body in bodies:
            asked = {"model": body["model"], **({"messages": body["messages"]} if "messages" in body
                                                else {"prompt": body["prompt"]})}
            reply = client.post("/tokenize", json=asked)
            reply.raise_for_status()
            requests.append(_PreparedRequest(body, reply.json()["tokens"]))
    return requests


async def _one_stream(port: int, path: str, body: dict, start: float) -> _RawStream:
    payload = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode() + payload)
    stream = _RawStream(bytearray())
    while chunk := await reader.read(65536):
        if not stream.raw:
            stream.first_byte_s = time.perf_counter() - start
        stream.raw += chunk
    stream.end_s = time.perf_counter() - start
    writer.close()
    return stream


async def _all_streams(port: int, path: str, requests: list[_PreparedRequest]) -> tuple[float, list[_RawStream]]:
    start = time.perf_counter()
    streams = await asyncio.gather(*(_one_stream(port, path, r.body, start) for r in requests))
    return time.perf_counter() - start, streams


def _events(raw: bytes) -> list[dict]:
    """The JSON events of one chunked SSE response."""
    head, _, rest = bytes(raw).partition(b"\r\n\r\n")
    status = head.split(b"\r\n", 1)[0]
    if b" 200 " not in status + b" ":
        raise RuntimeError(f"the server answered {status.decode()}: {rest[:300]!r}")
    body = bytearray()
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        body += rest[:size]
        rest = rest[size + 2:]
    events = []
    for line in body.decode().split("\n"):
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line[6:]))
    return events


def _streamed_text(events: list[dict]) -> tuple[str, int]:
    """The text a stream carried (reasoning and answer, in order) and its usage's completion tokens."""
    parts, tokens = [], 0
    for event in events:
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
        for choice in event.get("choices", ()):
            delta = choice.get("delta")
            if delta is None:
                parts.append(choice.get("text", ""))
                continue
            parts.append(delta.get("reasoning_content") or "")
            parts.append(delta.get("content") or "")
            for call in delta.get("tool_calls") or ():
                parts.append(call["function"].get("name") or "")
                parts.append(call["function"].get("arguments") or "")
    return "".join(parts), tokens


def _offline(llm, requests: list[_PreparedRequest], params) -> tuple[float, float, list]:
    """Wall and CPU seconds of one generate call, and its outputs."""
    start, cpu = time.perf_counter(), time.process_time()
    outputs = llm.generate([r.prompt_token_ids for r in requests], params)
    return time.perf_counter() - start, time.process_time() - cpu, outputs


def _cpu_seconds(pid: int) -> float:
    """CPU time (user + system, all threads) a process and its live children (the engine core process) have used
    so far (Linux)."""
    proc = Path(f"/proc/{pid}")
    fields = (proc / "stat").read_text().rpartition(")")[2].split()
    children = {int(child) for task in proc.glob("task/*") for child in (task / "children").read_text().split()}
    own = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return own + sum(_cpu_seconds(child) for child in children if Path(f"/proc/{child}").exists())


def load_average() -> str:
    return " / ".join(f"{x:.1f}" for x in os.getloadavg())


def run(args: argparse.Namespace) -> dict:
    from engine import LLM, SamplingParams

    flags = _engine_flags(args)
    port = free_port()
    argv = [sys.executable, "-m", "server.cli", "serve", "--model", args.model, "--port", str(port),
            "--log-level", "warning", "--engine-process", args.engine_process]
    for name, value in flags.items():
        argv += [f"--{name.replace('_', '-')}", str(value)]
    log_dir = Path(tempfile.mkdtemp(prefix="kvserve-bench-serve-"))
    threads = {} if args.torch_threads is None else {"OMP_NUM_THREADS": str(args.torch_threads)}
    server = Process("kvserve serve", argv, log_dir / "serve.log", env=threads)
    load_before = load_average()
    server.start()
    try:
        url = f"http://127.0.0.1:{port}"
        server.wait_http(url + "/health", 300)
        requests = _with_prompt_ids(url, _bodies(args, args.model))
        # Chat keeps special tokens in the text (the parsers read the markers); completions drop them.
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True,
                                skip_special_tokens=args.api != "chat")
        path = "/v1/chat/completions" if args.api == "chat" else "/v1/completions"
        if args.torch_threads is not None:
            import torch

            torch.set_num_threads(args.torch_threads)
        llm = LLM(args.model, **flags)
        llm.generate([requests[0].prompt_token_ids], SamplingParams(max_tokens=2))  # warm-up, off the clock
        asyncio.run(_all_streams(port, path, requests[:2]))
        offline_s = http_s = offline_cpu = http_cpu = float("inf")
        for _ in range(args.repeats):  # the sides take turns, so a slow spell of the machine hits both alike
            elapsed, cpu, outputs = _offline(llm, requests, params)
            offline_s, offline_cpu = min(offline_s, elapsed), min(offline_cpu, cpu)
            cpu = _cpu_seconds(server.proc.pid)
            elapsed, streams = asyncio.run(_all_streams(port, path, requests))
            http_s, http_cpu = min(http_s, elapsed), min(http_cpu, _cpu_seconds(server.proc.pid) - cpu)
    finally:
        server.stop()
    load_after = load_average()

    offline_tokens = sum(len(o.token_ids) for o in outputs)
    texts, http_tokens = zip(*(_streamed_text(_events(s.raw)) for s in streams))
    http_tokens = sum(http_tokens)
    same_text = sum(streamed == o.text for streamed, o in zip(texts, outputs))
    ttft = sorted(s.first_byte_s for s in streams)
    figures = {
        "model": args.model, "api": args.api, "streams": args.streams, "max_tokens": args.max_tokens,
        "torch_threads": args.torch_threads, "engine_process": args.engine_process,
        "offline_s": offline_s, "http_s": http_s, "offline_tokens": offline_tokens, "http_tokens": http_tokens,
        "offline_tokens_per_s": offline_tokens / offline_s, "http_tokens_per_s": http_tokens / http_s,
        "ratio": (http_tokens / http_s) / (offline_tokens / offline_s), "same_text": same_text,
        "offline_cpu_us_per_token": 1e6 * offline_cpu / offline_tokens, "server_cpu_us_per_token": 1e6 * http_cpu / http_tokens,
        "http_first_byte_p50_s": ttft[len(ttft) // 2], "load_average": f"{load_before} -> {load_after}",
        "server_log": str(log_dir / "serve.log"),
    }
    rows = [["offline `LLM.generate`", f"{offline_s:.2f}", offline_tokens, f"{figures['offline_tokens_per_s']:.0f}", "",
             f"{figures['offline_cpu_us_per_token']:.0f}"],
            [f"HTTP, {args.streams} streams ({path})", f"{http_s:.2f}", http_tokens,
             f"{figures['http_tokens_per_s']:.0f}", f"**{figures['ratio']:.2f}x**",
             f"{figures['server_cpu_us_per_token']:.0f}"]]
    figures["markdown"] = markdown_table(["side", "time (s)", "output tokens", "tokens/s", "HTTP / offline",
                                          "CPU us per token"], rows)
    print(figures["markdown"])
    print(f"\n{same_text}/{len(streams)} streamed texts equal the offline texts; load average (1/5/15 min) "
          f"{figures['load_average']}")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve.md").write_text(figures["markdown"] + "\n")
    return figures
