"""The real agent clients, from npm at pinned versions, against a real `kvserve serve --model qwen3-tiny` on
127.0.0.1: Claude Code (Anthropic Messages), Codex (OpenAI Responses) and Qwen Code (OpenAI chat) each run two turns
of one session, and each client's own usage report shows the second turn read at least half its prompt from the
prefix cache. .ci/run installs the clients (`npm install`, about 40 s) into KVSERVE_AGENT_CLIENTS (default
~/.cache/kvserve/agent-clients) before the tests; elsewhere the tests skip, saying why, when they are not there.
qwen3-tiny's replies are noise, so the server caps every reply at 16 tokens (--max-output-tokens). Slow tier."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.slow

CLIENTS = {"claude": "@anthropic-ai/claude-code@2.1.328", "codex": "@openai/codex@0.169.0",
           "qwen": "@qwen-code/qwen-code@0.24.4"}
MODEL = "qwen3-tiny"
# Under tool_choice auto each turn's tool-call grammar (20+ agent tools) is optional: no turn waits for it, it
# compiles in the background for the next turn. Claude Code's takes 94 s of a core, and noise capped at 16 tokens
# makes no calls to check: give the background compile 2 s, so that it does not take a core from the tests.
GRAMMAR_WAIT = ("--grammar-background-compile-timeout", "2")
CODEX_CONFIG = """model = "qwen3-tiny"
model_provider = "kvserve"

[model_providers.kvserve]
name = "kvserve"
base_url = "{url}/v1"
wire_api = "responses"
env_key = "KVSERVE_API_KEY"
"""


def clients_dir() -> Path:
    return Path(os.environ.get("KVSERVE_AGENT_CLIENTS", Path.home() / ".cache/kvserve/agent-clients"))


@pytest.fixture(scope="module")
def bins() -> Path:
    """The clients' executables at their pinned versions. Outside CI a machine without them (or without node)
    skips these tests, saying how to install them; in CI (`.ci/run` installs them and sets KVSERVE_CI) their
    absence is a failure."""
    prefix = clients_dir()
    stamp = prefix / "pinned.json"
    missing = None
    if shutil.which("node") is None:
        missing = "node is not installed (https://nodejs.org, version 20 or newer)"
    elif not (stamp.exists() and stamp.read_text() == json.dumps(sorted(CLIENTS.values()))):
        missing = (f"the agent clients are not installed at their pinned versions in {prefix} (the agent-client "
                   f"lines of .ci/run install them: npm install --prefix {prefix} {' '.join(CLIENTS.values())}, "
                   f"then {stamp.name})")
    if missing is not None:
        if os.environ.get("KVSERVE_CI"):
            pytest.fail(missing)
        pytest.skip(missing)
    return prefix / "node_modules" / ".bin"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`kvserve serve` as a user starts it; the agents' prompts are 8-12k tokens, so the full 40,960 context."""
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with log.open("w") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "server.cli", "serve", "--model", MODEL, "--port", "0", "--max-model-len", "40960",
             "--max-output-tokens", "16", "--num-kv-blocks", "8192", "--log-level", "warning", *GRAMMAR_WAIT],
            stdout=subprocess.DEVNULL, stderr=sink, text=True,
        )
    try:
        deadline = time.monotonic() + 180
        while not (found := re.search(r"serving \S+ at (http://127\.0\.0\.1:\d+)/v1", log.read_text())):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        yield found.group(1)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def _run(argv: list[str], home: Path, env: dict[str, str]) -> str:
    project = home / "project"
    project.mkdir(parents=True, exist_ok=True)
    # PWD too: OpenCode takes its project directory (where it reads opencode.json) from it, not from the real cwd
    done = subprocess.run(argv, cwd=project, env={**os.environ, "HOME": str(home), "PWD": str(project), **env},
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, (argv, done.stdout[-2000:], done.stderr[-2000:])
    return done.stdout


def test_claude_code_two_turns_reads_the_cache(bins: Path, server: str, tmp_path: Path) -> None:
    env = {"ANTHROPIC_BASE_URL": server, "ANTHROPIC_API_KEY": "unused"}
    command = [str(bins / "claude"), "--model", MODEL, "--output-format", "json", "-p"]
    first = json.loads(_run([*command, "What is in this directory?"], tmp_path, env))
    second = json.loads(_run([str(bins / "claude"), "-c", *command[1:], "And now?"], tmp_path, env))
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


def test_codex_two_turns_reads_the_cache(bins: Path, server: str, tmp_path: Path) -> None:
    (tmp_path / ".codex").mkdir()
    (tmp_path / ".codex" / "config.toml").write_text(CODEX_CONFIG.format(url=server))
    env = {"KVSERVE_API_KEY": "unused"}
    command = [str(bins / "codex"), "exec", "--json", "--skip-git-repo-check"]
    first = _codex_usage(_run([*command, "What is in this directory?"], tmp_path, env))
    total = _codex_usage(_run([*command, "resume", "--last", "And now?"], tmp_path, env))
    # A resumed thread reports its usage so far: the second turn is the difference.
    second_input = total["input_tokens"] - first["input_tokens"]
    second_cached = total["cached_input_tokens"] - first["cached_input_tokens"]
    assert second_input > 0 and second_cached >= second_input / 2, (first, total)


def test_qwen_code_two_turns_reads_the_cache(bins: Path, server: str, tmp_path: Path) -> None:
    env = {"OPENAI_BASE_URL": f"{server}/v1", "OPENAI_API_KEY": "unused", "OPENAI_MODEL": MODEL}
    command = [str(bins / "qwen"), "--auth-type", "openai", "-o", "json"]

    def result(stdout: str) -> dict:
        return next(e for e in json.loads(stdout) if e["type"] == "result")

    first = result(_run([*command, "What is in this directory?"], tmp_path, env))
    second = result(_run([*command, "-c", "And now?"], tmp_path, env))
    for turn in (first, second):
        assert turn["is_error"] is False and turn["subtype"] == "success", turn
    assert second["session_id"] == first["session_id"]
    usage = second["usage"]
    assert usage["cache_read_input_tokens"] >= usage["input_tokens"] / 2, usage
    assert httpx.get(f"{server}/health", timeout=30).json()["status"] == "ok"
