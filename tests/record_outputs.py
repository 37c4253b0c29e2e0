"""Record what kvserve answers to a fixed set of greedy requests, to show a refactor changed nothing a user sees.

    python -m tests.record_outputs record before.json      # on the commit before the change (a git worktree)
    python -m tests.record_outputs record after.json       # on the commit after it
    python -m tests.record_outputs compare before.json after.json

The set: the offline API on a dense, a hybrid, an MLA and a compressed-attention model (tokens and cached counts,
cold then hot), and every HTTP API (chat with and without tools, streamed chat, completions, Anthropic Messages,
OpenAI Responses) through `kvserve serve` in a subprocess, with the fields that differ run to run (ids, times)
removed. Compare exits 1 and names every request whose answer differs.
"""
from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

OFFLINE_MODELS = ("qwen3-tiny", "qwen3.6-tiny", "deepseek-v3-tiny", "deepseek-v4-tiny")
HTTP_MODEL = "qwen3-tiny"
VOLATILE = {"id", "created", "created_at", "system_fingerprint", "call_id", "item_id", "response_id", "timings"}
TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file",
                                           "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                                          "required": ["path"]}}}]
MESSAGES = [{"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": "Why does main.py crash on start?"}]


def offline() -> dict[str, Any]:
    from engine import LLM, SamplingParams

    rng = random.Random(7)
    prompts = [[rng.randrange(100, 50_000) for _ in range(n)] for n in (5, 17, 40)]
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    results = {}
    for model in OFFLINE_MODELS:
        llm = LLM(model, block_size=16, num_kv_blocks=64)
        runs = [llm.generate(prompts, greedy) for _ in ("cold", "hot")]
        results[model] = [[(o.token_ids, o.num_cached_tokens) for o in run] for run in runs]
        llm.close()
    return results


def _clean(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    if isinstance(value, str):
        return re.sub(r"\b(chatcmpl|cmpl|msg|resp|call|fc|rs|toolu)_[0-9A-Za-z_-]+", r"\1_*", value)
    return value


def http() -> dict[str, Any]:
    import httpx

    proc = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", "--model", HTTP_MODEL, "--port", "0",
                             "--block-size", "4", "--max-model-len", "2048", "--log-level", "warning"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stderr:
            if found := re.search(r"serving \S+ at (http://127\.0\.0\.1:\d+)/v1", line):
                url = found.group(1)
                break
        else:
            raise RuntimeError("the server exited before it served")
        bodies = {
            "chat": ("/v1/chat/completions", dict(messages=MESSAGES)),
            "chat_tools": ("/v1/chat/completions", dict(messages=MESSAGES, tools=TOOLS)),
            "completions": ("/v1/completions", dict(prompt="def fibonacci(n):")),
            "messages": ("/v1/messages", dict(system="You are a coding agent.", tools=[
                {"name": "read_file", "description": "Read a file", "input_schema": TOOLS[0]["function"]["parameters"]}],
                messages=[{"role": "user", "content": "Why does main.py crash on start?"}])),
            "responses": ("/v1/responses", dict(instructions="You are a coding agent.",
                                                input="Why does main.py crash on start?", tools=[
                                                    {"type": "function", **TOOLS[0]["function"]}])),
        }
        results = {}
        with httpx.Client(base_url=url, timeout=120, headers={"x-api-key": "unused"}) as client:
            for name, (path, body) in bodies.items():
                key = "max_output_tokens" if path == "/v1/responses" else "max_tokens"
                reply = client.post(path, json={"model": HTTP_MODEL, "temperature": 0, key: 12, **body})
                results[name] = [reply.status_code, _clean(reply.json())]
            stream = client.post("/v1/chat/completions", json={"model": HTTP_MODEL, "temperature": 0, "max_tokens": 12,
                                                               "messages": MESSAGES, "stream": True})
            results["chat_stream"] = [stream.status_code, [_clean(json.loads(line[6:])) for line in stream.text.splitlines()
                                                           if line.startswith("data: {")]]
        return results
    finally:
        proc.kill()
        proc.wait(30)


def main(argv: list[str]) -> int:
    if argv[:1] == ["record"] and len(argv) == 2:
        Path(argv[1]).write_text(json.dumps({"offline": offline(), "http": http()}, indent=1, sort_keys=True))
        return 0
    if argv[:1] == ["compare"] and len(argv) == 3:
        before, after = (json.loads(Path(p).read_text()) for p in argv[1:])
        differ = [f"{part}/{name}" for part in ("offline", "http") for name in before[part]
                  if before[part][name] != after[part].get(name)]
        total = sum(len(before[part]) for part in before)
        print(f"{total - len(differ)} of {total} answers identical" + (": differ " + ", ".join(differ) if differ else ""))
        return 1 if differ else 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
