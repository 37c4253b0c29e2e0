"""Records tests/server/inspector/data/agent_session.jsonl: one coding-agent session against `kvserve serve --record`
(qwen3-tiny, greedy), as an agent drives it: the model's own replies and tool calls go back into the history, with
the tools' (scripted) results. The inspector's browser test replays it. Token ids are left out of the file (the
replay re-renders every body); run it again after a change to qwen3-tiny or its template:

    python -m tests.server.data.record_agent_session
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

from engine.config import EngineConfig
from server.pipeline.context import ServerSettings, load_context
from tests.server.conftest import serve

OUT = Path(__file__).with_name("agent_session.jsonl")
SESSION = "agent-session-0001"
SYSTEM = "\n".join([
    "You are a coding agent working in the user's repository.",
    "Working directory: /home/dev/parser",
    "Today's date: 2026-12-01.",
    "Use the tools to read files, run the tests and edit code; never guess a file's contents.",
    "Keep each edit minimal and explain it in one sentence.",
    "When the tests pass, stop and summarize what changed.",
])
TOOLS = [
    {"type": "function", "function": {"name": "read_file", "description": "Read a file of the repository.",
                                      "parameters": {"type": "object", "properties": {"path": {"type": "string", "maxLength": 32}},
                                                     "required": ["path"]}}},
    {"type": "function", "function": {"name": "run_tests", "description": "Run pytest with the given arguments.",
                                      "parameters": {"type": "object", "properties": {"args": {"type": "string", "maxLength": 32}},
                                                     "required": ["args"]}}},
    {"type": "function", "function": {"name": "edit_file", "description": "Replace text in a file.",
                                      "parameters": {"type": "object", "properties": {
                                          "path": {"type": "string", "maxLength": 32}, "old": {"type": "string", "maxLength": 32},
                                          "new": {"type": "string", "maxLength": 32}}, "required": ["path", "old", "new"]}}},
]
TOOL_RESULTS = [
    "FAILED tests/test_parser.py::test_nested - AssertionError: assert ['a', ['b']] == ['a', ['b', 'c']]",
    "def parse(tokens):\n    out, stack = [], []\n    for t in tokens:\n        if t == '[':\n            stack.append(out)"
    "\n            out = []\n        elif t == ']':\n            inner, out = out, stack.pop()\n            out.append(inner)"
    "\n            break\n        else:\n            out.append(t)\n    return out",
    "Replaced 1 occurrence in src/parser.py",
    "1 passed in 0.02s",
    "CHANGELOG.md: ## Unreleased\n- nothing yet",
    "Replaced 1 occurrence in CHANGELOG.md",
]
USER_TURNS = {0: "tests/test_parser.py::test_nested fails. Find the bug and fix it.",
              5: "Also add a line about the fix to CHANGELOG.md."}
REQUESTS = 8


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        record = Path(tmp) / "session.jsonl"
        ctx = load_context("qwen3-tiny", EngineConfig(block_size=16, num_kv_blocks=1024, max_model_len=8192),
                           ServerSettings(), record_path=str(record))
        with serve(ctx) as url:
            import openai

            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            messages: list[dict] = [{"role": "system", "content": SYSTEM}]
            results = iter(TOOL_RESULTS)
            for turn in range(REQUESTS):
                if turn in USER_TURNS:
                    messages.append({"role": "user", "content": USER_TURNS[turn]})
                last = turn == REQUESTS - 1
                reply = client.chat.completions.create(
                    model="qwen3-tiny", messages=messages, tools=TOOLS, tool_choice="none" if last else "required",
                    max_tokens=160, temperature=0, prompt_cache_key=SESSION,
                    extra_body={"chat_template_kwargs": {"enable_thinking": False}},
                ).choices[0].message
                assistant = reply.model_dump(exclude_none=True, include={"role", "content", "tool_calls"})
                messages.append(assistant)
                for call in reply.tool_calls or []:
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": next(results, "ok")})
        rows = [json.loads(line) for line in record.read_text().splitlines()]
    keep = ("request_id", "endpoint", "model", "body", "session", "cached_tokens", "finish_reason")
    OUT.write_text("".join(json.dumps({k: row[k] for k in keep}, ensure_ascii=False) + "\n" for row in rows))
    print(f"wrote {len(rows)} requests to {OUT}")


if __name__ == "__main__":
    main()
