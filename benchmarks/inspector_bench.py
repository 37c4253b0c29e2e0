"""`kvserve bench inspector`: what the cache inspector (`kvserve serve --ui`) costs with a full window of requests.

The same requests (concurrent agent sessions over shared project heads: benchmarks/prefix's `projects` workload)
go to `kvserve serve` twice, without and with `--ui`, one server at a time. Side by side: the server's resident
memory before and after them (the difference in growth is what the inspector holds; its own estimate is shown too),
and with `--ui` how long the page takes to load in headless Chromium (benchmarks/browser.py), from navigation start
until its first view is painted: the sessions view, the largest session, the longest prompt and the cache view, each
loaded `--loads` times in a fresh tab (median and slowest), at 10 requests (the baseline) and after all of them.
The machine's load average is printed beside the figures (other engineers share the cores).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from benchmarks import browser
from benchmarks.prefix.report import markdown_table
from benchmarks.prefix.catalog import build_workloads
from benchmarks.prefix.workloads import ChatRequest, WorkloadParams
from benchmarks.router_procs import Process, free_port

OPERATOR_KEY = "sk-bench-operator"
BASELINE_REQUESTS = 10


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="qwen3-tiny", help="registry model (default: %(default)s)")
    parser.add_argument("--requests", type=int, default=1000, help="requests sent, all kept by the inspector "
                        "(default: %(default)s)")
    parser.add_argument("--sessions", type=int, default=50, help="concurrent agent sessions (default: %(default)s)")
    parser.add_argument("--loads", type=int, default=5, help="page loads per view (default: %(default)s)")
    parser.add_argument("--clients", type=int, default=4, help="sessions sent at once (default: %(default)s)")


def run(args: argparse.Namespace) -> dict:
    if (reason := browser.missing()) is not None:
        raise SystemExit(f"kvserve bench inspector: {reason}")
    steps = max(1, -(-args.requests // args.sessions) - 1)  # each session: a first request, then `steps` tool calls
    params = WorkloadParams(sessions=args.sessions, projects=4, session_steps=steps, head_words=400,
                            result_words=(20, 120), reasoning_words=(5, 20))
    (workload,) = build_workloads("projects", params)
    requests = workload.requests[: args.requests]
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = {}
    for ui in (False, True):
        runs["ui" if ui else "plain"] = _serve_and_send(args, requests, ui, out_dir)
    runs["ui"]["traced_bytes"] = _traced_bytes(args.model, out_dir / "requests_ui.jsonl")
    figures = _figures(args, requests, runs)
    (out_dir / "inspector.md").write_text(figures["markdown"] + "\n")
    print(figures["markdown"])
    return figures


def _serve_and_send(args: argparse.Namespace, requests: list[ChatRequest], ui: bool, out_dir: Path) -> dict:
    port = free_port()
    argv = [sys.executable, "-m", "server.cli", "serve", "--model", args.model, "--port", str(port),
            "--block-size", "16", "--num-kv-blocks", "8192", "--max-model-len", "32768", "--log-level", "warning",
            "--operator-key", OPERATOR_KEY, "--record", str(out_dir / f"requests{'_ui' if ui else ''}.jsonl")]
    (out_dir / f"requests{'_ui' if ui else ''}.jsonl").unlink(missing_ok=True)
    if ui:
        argv += ["--ui", "--ui-max-requests", str(len(requests))]
    process = Process(f"kvserve{' --ui' if ui else ''}", argv, out_dir / f"serve{'_ui' if ui else ''}.log")
    url = f"http://127.0.0.1:{port}"
    process.start()
    try:
        process.wait_http(f"{url}/health", timeout=600)
        _send(url, requests[:BASELINE_REQUESTS], args.clients, args.model)
        result: dict = {}
        if ui:
            result["baseline_loads"] = _page_loads(url, args.loads)
        result["rss_before"] = _rss(process.proc.pid)  # the growth below is the sending alone
        started = time.perf_counter()
        _send(url, requests[BASELINE_REQUESTS:], args.clients, args.model)
        result["send_s"] = time.perf_counter() - started
        result["rss_after"] = _rss(process.proc.pid)
        if ui:
            result["loads"] = _page_loads(url, args.loads)
            inspector = _get(url, "cache")["inspector"]
            result["inspector"] = inspector
        result["load_average"] = os.getloadavg()
        return result
    finally:
        process.stop()


def _send(url: str, requests: list[ChatRequest], clients: int, model: str) -> None:
    """Each session's requests in order; ``clients`` sessions at a time."""
    by_session: dict[str, list[ChatRequest]] = {}
    for r in requests:
        by_session.setdefault(r.session, []).append(r)

    def session(reqs: list[ChatRequest]) -> None:
        with httpx.Client(base_url=url, timeout=600, headers={"Authorization": f"Bearer {OPERATOR_KEY}"}) as http:
            for r in reqs:
                body = {"model": model, "messages": r.messages, "tools": r.tools, "max_tokens": 2, "temperature": 0,
                        "prompt_cache_key": r.session}
                http.post("/v1/chat/completions", json=body).raise_for_status()

    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(session, by_session.values()))


def _get(url: str, path: str) -> dict:
    return httpx.get(f"{url}/ui/api/{path}", headers={"Authorization": f"Bearer {OPERATOR_KEY}"}, timeout=120).json()


def _page_loads(url: str, loads: int) -> dict[str, list[float]]:
    """Load times (ms) of each view: the newest session (the page's default), the largest one, the longest prompt,
    the cache."""
    sessions = _get(url, "sessions")["sessions"]
    largest = max(sessions, key=lambda s: s["requests"])["id"]
    longest = max((r for s in sessions for r in _get(url, f"sessions/{s['id']}")["requests"]),
                  key=lambda r: r["prompt_tokens"])["id"]
    views = {"sessions": "/sessions", "largest session": f"/sessions/{largest}", "longest prompt": f"/requests/{longest}",
             "cache": "/cache"}
    times: dict[str, list[float]] = {name: [] for name in views}
    with browser.chromium() as context:
        for _ in range(loads):
            for name, route in views.items():
                page, ms = browser.open_inspector(context, url, OPERATOR_KEY, route)
                times[name].append(ms)
                page.close()
    return times


def _traced_bytes(model: str, record: Path) -> int:
    """What an inspector holds after the recorded requests, measured in this process with tracemalloc: the same
    token ids, sessions, salts and conversations fed to a fresh one."""
    import tracemalloc

    from transformers import AutoTokenizer

    from engine.kv.block_hashing import BlockHasher
    from engine.registry import get_model_spec, model_identity, resolve_model
    from server.cache.cache_salt import salt_tenant
    from server.inspector.attribution import Conversation
    from server.inspector.store import Inspector, Observation
    from server.cache.normalize import normalize_for_cache
    from server.rendering import renderer_for_model

    spec = get_model_spec(model)
    model_dir = resolve_model(model)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    renderer = renderer_for_model(spec.template, tokenizer)
    lines = record.read_text().splitlines()
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731

    def observe(inspector: Inspector, line: str) -> None:
        row = json.loads(line)  # parsed while traced: what the inspector keeps of it is counted, the rest freed
        conversation = Conversation(normalize_for_cache(row["body"]["messages"], renderer), row["body"].get("tools"))
        inspector.observe(Observation(
            row["request_id"], row["endpoint"], row["cache_salt"], row["session"], row["prompt_token_ids"],
            row["output_token_ids"], row["cached_tokens"], 0, 0, None, None, None,
            row["finish_reason"], conversation=conversation), salt_tenant(row["cache_salt"]))

    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    inspector = Inspector(BlockHasher(16, model_identity(spec, model_dir)), model, len(lines), decode)
    for line in lines:
        observe(inspector, line)
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return held


def _rss(pid: int) -> int:
    """Resident memory of a process, bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def _figures(args: argparse.Namespace, requests: list[ChatRequest], runs: dict) -> dict:
    plain, ui = runs["plain"], runs["ui"]
    mib = 2**20
    growth = {name: (r["rss_after"] - r["rss_before"]) / mib for name, r in runs.items()}
    sizes = [len(json.dumps(r.messages)) for r in requests]
    memory_rows = [
        ["kvserve serve", f"{plain['rss_before'] / mib:,.0f}", f"{plain['rss_after'] / mib:,.0f}",
         f"{growth['plain']:+,.1f}", f"{plain['send_s']:.0f}", ""],
        ["kvserve serve --ui", f"{ui['rss_before'] / mib:,.0f}", f"{ui['rss_after'] / mib:,.0f}",
         f"{growth['ui']:+,.1f}", f"{ui['send_s']:.0f}", f"{ui['inspector']['memory_bytes'] / mib:,.1f}"],
    ]
    load_rows = []
    for view in ui["loads"]:
        base, full = ui["baseline_loads"][view], ui["loads"][view]
        load_rows.append([view, f"{statistics.median(base):,.0f}", f"{max(base):,.0f}",
                          f"{statistics.median(full):,.0f}", f"{max(full):,.0f}",
                          f"{statistics.median(full) / statistics.median(base):.2f}x"])
    average = " / ".join(f"{x:.1f}" for x in ui["load_average"])
    markdown = "\n\n".join([
        f"{len(requests):,} requests in {args.sessions} agent sessions over 4 project heads ({args.model}; messages "
        f"of {min(sizes) / 1024:.0f}-{max(sizes) / 1024:.0f} KiB of JSON), all kept by the inspector "
        f"({ui['inspector']['requests']:,} requests, {ui['inspector']['sessions']} sessions, "
        f"{ui['inspector']['trie_blocks']:,} distinct blocks of 16 tokens); load average {average} (1/5/15 min) "
        f"after the run",
        markdown_table(["server", "RSS before (MiB)", "RSS after (MiB)", "growth (MiB)", "send time (s)",
                        "inspector's own estimate (MiB)"], memory_rows),
        f"The inspector's extra memory: {ui['traced_bytes'] / mib:,.1f} MiB of Python objects, measured with "
        f"tracemalloc on the same recorded requests fed to an inspector in the benchmark's process; the servers' "
        f"resident memory grew {growth['ui'] - growth['plain']:+,.1f} MiB more with --ui than without over the same "
        f"requests.",
        markdown_table(["view", f"median ms ({BASELINE_REQUESTS} requests)", f"slowest ms ({BASELINE_REQUESTS})",
                        f"median ms ({len(requests):,} requests)", f"slowest ms ({len(requests):,})",
                        "median ratio"], load_rows),
    ])
    return {"requests": len(requests), "sessions": args.sessions, "runs": runs, "extra_rss_mib":
            growth["ui"] - growth["plain"], "inspector_traced_mib": ui["traced_bytes"] / mib,
            "load_average": ui["load_average"], "markdown": markdown}
