"""The real Codex CLI (@openai/codex, pinned in tests/clients/harness.py) with its built-in `openai` provider pointed
at `kvserve serve` (`openai_base_url`, as a user points it at a local server) and a small auto-compact limit: it
talks the Responses API over a WebSocket from its first try (its warm-up, then each turn continuing it by
`previous_response_id`), compacts remotely (a `compaction_trigger` answered with exactly one sealed `compaction`
item) several times, and finishes every turn; the first request after each compaction reads the head (instructions
and tools) from the prefix cache. Slow tier: five Codex turns of ~8k-token prompts on qwen3-tiny."""
from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from server.api.responses_input import chat_messages, chat_tools
from tests.clients.harness import installed_bins, run_client, serve

pytestmark = pytest.mark.slow

MODEL = "qwen3-tiny"
KEY = "sk-codex-compaction"
TURNS = 5
CONFIG = """model = "{model}"
openai_base_url = "{url}/v1"
model_auto_compact_token_limit = {limit}
"""


def _events(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def _kinds(body: dict) -> list[str]:
    return [item.get("type", "message") for item in body["input"]] if isinstance(body["input"], list) else []


def _head_tokens(url: str, body: dict) -> int:
    """The prompt tokens of the request's instructions (the built-in provider sends them as its first input item, a
    developer message) and tools alone: what each epoch keeps."""
    tools, names = chat_tools(body.get("tools"))
    assert body["input"][0]["role"] == "developer", body["input"][0]
    answer = httpx.post(f"{url}/tokenize", headers={"Authorization": f"Bearer {KEY}"}, timeout=60, json={
        "model": MODEL, "messages": chat_messages(body["input"][:1], names), "tools": tools,
        "add_generation_prompt": False})
    return answer.json()["count"]


def test_codex_compacts_remotely_over_a_websocket_and_reads_the_head_from_the_cache(tmp_path: Path) -> None:
    bins = installed_bins()
    record = tmp_path / "requests.jsonl"
    with serve(MODEL, tmp_path / "serve.log", "--api-key", KEY, "--record", str(record)) as url:
        config = tmp_path / ".codex" / "config.toml"
        config.parent.mkdir()
        config.write_text(CONFIG.format(model=MODEL, url=url, limit=10**9))
        command = [str(bins / "codex"), "exec", "--json", "--skip-git-repo-check"]
        env = {"CODEX_API_KEY": KEY}
        first = _events(run_client([*command, "What is in this directory?"], tmp_path, env))
        usage = next(e["usage"] for e in first if e["type"] == "turn.completed")
        # From the next turn on, past the limit: each turn's context (the last one's, plus a turn) needs compacting
        config.write_text(CONFIG.format(model=MODEL, url=url, limit=usage["input_tokens"] + 24))
        runs = [first] + [_events(run_client([*command, "resume", "--last", f"And now? ({turn})"], tmp_path, env))
                          for turn in range(2, TURNS + 1)]
        records = [json.loads(line) for line in record.read_text().splitlines()]
        head = _head_tokens(url, records[0]["body"])

    for events in runs:
        assert any(e["type"] == "turn.completed" for e in events), events
        problems = [e for e in events if e["type"] in ("error", "turn.failed") or (
            e["type"] == "item.completed" and e["item"]["type"] == "error" and "metadata" not in e["item"]["message"])]
        assert not problems, problems  # no reconnect, no fallback from WebSockets to HTTP, no failed turn
    # Every request came over the WebSocket (Codex stamps its WebSocket requests' metadata)
    assert all("x-codex-ws-stream-request-start-ms" in r["body"].get("client_metadata", {}) for r in records)
    compactions = [i for i, r in enumerate(records) if _kinds(r["body"])[-1:] == ["compaction_trigger"]]
    assert len(compactions) >= 2, [_kinds(r["body"])[-2:] for r in records]
    for i in compactions:
        after = next(r for r in records[i + 1:] if "compaction" in _kinds(r["body"]))
        assert after["cached_tokens"] >= head // 16 * 16 > 0, (after["cached_tokens"], head)
