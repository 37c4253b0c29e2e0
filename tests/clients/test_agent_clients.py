"""The real agent clients, from npm at pinned versions, against a real `kvserve serve --model qwen3-tiny` on
127.0.0.1: Claude Code (Anthropic Messages), Codex (OpenAI Responses) and Qwen Code (OpenAI chat) each run two turns
of one session, and each client's own usage report shows the second turn read at least half its prompt from the
prefix cache. Claude Code's and Codex's sessions on qwen3-tiny are the dense runs of test_hybrid_agent_clients.py,
which checks their reports there (tests/clients/sessions.py: assert_turn2_read_the_cache) instead of running the same
sessions twice; Qwen Code runs here. .ci/run installs the clients (`npm install`, about 40 s) into
KVSERVE_AGENT_CLIENTS (default ~/.cache/kvserve/agent-clients) before the tests; elsewhere the tests skip, saying why,
when they are not there. qwen3-tiny's replies are noise, so the server caps every reply at 16 tokens
(--max-output-tokens). Slow tier."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.clients.harness import installed_bins, run_client, serve

pytestmark = pytest.mark.slow

MODEL = "qwen3-tiny"


@pytest.fixture(scope="module")
def bins() -> Path:
    return installed_bins()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with serve(MODEL, tmp_path_factory.mktemp("serve") / "serve.log") as url:
        yield url


@pytest.mark.slow
def test_qwen_code_two_turns_reads_the_cache(bins: Path, server: str, tmp_path: Path) -> None:
    env = {"OPENAI_BASE_URL": f"{server}/v1", "OPENAI_API_KEY": "unused", "OPENAI_MODEL": MODEL}
    command = [str(bins / "qwen"), "--auth-type", "openai", "-o", "json"]

    def result(stdout: str) -> dict:
        return next(e for e in json.loads(stdout) if e["type"] == "result")

    first = result(run_client([*command, "What is in this directory?"], tmp_path, env))
    second = result(run_client([*command, "-c", "And now?"], tmp_path, env))
    for turn in (first, second):
        assert turn["is_error"] is False and turn["subtype"] == "success", turn
    assert second["session_id"] == first["session_id"]
    usage = second["usage"]
    assert usage["cache_read_input_tokens"] >= usage["input_tokens"] / 2, usage
    assert httpx.get(f"{server}/health", timeout=30).json()["status"] == "ok"
