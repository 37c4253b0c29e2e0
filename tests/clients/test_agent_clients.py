"""The real agent clients, from npm at pinned versions, against a real `kvserve serve --model qwen3-tiny` on
127.0.0.1: Claude Code (Anthropic Messages), Codex (OpenAI Responses) and Qwen Code (OpenAI chat) each run two turns
of one session, and each client's own usage report shows the second turn read at least half its prompt from the
prefix cache. .ci/run installs the clients (`npm install`, about 40 s) into KVSERVE_AGENT_CLIENTS (default
~/.cache/kvserve/agent-clients) before the tests; elsewhere the tests skip, saying why, when they are not there.
qwen3-tiny's replies are noise, so the server caps every reply at 16 tokens (--max-output-tokens). Slow tier."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.clients.harness import CODEX_CONFIG, installed_bins, run_client, serve

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
def test_claude_code_two_turns_reads_the_cache(bins: Path, server: str, tmp_path: Path) -> None:
    env = {"ANTHROPIC_BASE_URL": server, "ANTHROPIC_API_KEY": "unused"}
    command = [str(bins / "claude"), "--model", MODEL, "--output-format", "json", "-p"]
    first = json.loads(run_client([*command, "What is in this directory?"], tmp_path, env))
    second = json.loads(run_client([str(bins / "claude"), "-c", *command[1:], "And now?"], tmp_path, env))
    for turn in (first, second):
        assert turn["is_error"] is False and turn["subtype"] == "success", turn
    assert second["session_id"] == first["session_id"]
    usage = second["usage"]
    prompt = usage["input_tokens"] + usage["cache_read_input_tokens"] + usage["cache_creation_input_tokens"]
    assert usage["cache_read_input_tokens"] >= prompt / 2, usage


def _codex_usage(stdout: str) -> dict:
    events = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    assert any(e["type"] == "turn.completed" for e in events), events
    return next(e["usage"] for e in events if e["type"] == "turn.completed")


@pytest.mark.slow
def test_codex_two_turns_reads_the_cache(bins: Path, server: str, tmp_path: Path) -> None:
    (tmp_path / ".codex").mkdir()
    (tmp_path / ".codex" / "config.toml").write_text(CODEX_CONFIG.format(url=server, model=MODEL))
    env = {"KVSERVE_API_KEY": "unused"}
    command = [str(bins / "codex"), "exec", "--json", "--skip-git-repo-check"]
    first = _codex_usage(run_client([*command, "What is in this directory?"], tmp_path, env))
    total = _codex_usage(run_client([*command, "resume", "--last", "And now?"], tmp_path, env))
    # A resumed thread reports its usage so far: the second turn is the difference.
    second_input = total["input_tokens"] - first["input_tokens"]
    second_cached = total["cached_input_tokens"] - first["cached_input_tokens"]
    assert second_input > 0 and second_cached >= second_input / 2, (first, total)


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
