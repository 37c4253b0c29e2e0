"""What the agent-client tests share: the clients at their pinned versions (installed by `.ci/run`), `kvserve serve`
started as a user starts it, and one client command run in its own HOME."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

# The npm packages .ci/run installs (keep the two lists equal)
CLIENTS = {"claude": "@anthropic-ai/claude-code@2.1.328", "codex": "@openai/codex@0.169.0",
           "qwen": "@qwen-code/qwen-code@0.24.4"}
# Under tool_choice auto each turn's tool-call grammar (20+ agent tools) is optional: no turn waits for it, it
# compiles in the background for the next turn. Claude Code's takes 94 s of a core, and noise capped at 16 tokens
# makes no calls to check: give the background compile 2 s, so that it does not take a core from the tests.
GRAMMAR_WAIT = ("--grammar-background-compile-timeout", "2")
CODEX_CONFIG = """model = "{model}"
model_provider = "kvserve"

[model_providers.kvserve]
name = "kvserve"
base_url = "{url}/v1"
wire_api = "responses"
env_key = "KVSERVE_API_KEY"
"""


def clients_dir() -> Path:
    return Path(os.environ.get("KVSERVE_AGENT_CLIENTS", Path.home() / ".cache/kvserve/agent-clients"))


def installed_bins() -> Path:
    """The clients' executables at their pinned versions. Outside CI a machine without them (or without node)
    skips the test, saying how to install them; in CI (`.ci/run` installs them and sets KVSERVE_CI) their absence
    is a failure."""
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


@contextmanager
def serve(model: str, log: Path, *options: str) -> Iterator[str]:
    """`kvserve serve --model MODEL` as a user starts it for agents, its stderr in ``log``: the agents' prompts are
    8-12k tokens, so the full 40,960 context; the tiny random models' replies are noise, so capped at 16 tokens.
    Yields the server's base URL."""
    with log.open("w") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "server.cli", "serve", "--model", model, "--port", "0", "--max-model-len", "40960",
             "--max-output-tokens", "16", "--num-kv-blocks", "8192", "--log-level", "warning", *GRAMMAR_WAIT,
             *options],
            stdout=subprocess.DEVNULL, stderr=sink, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (found := re.search(r"serving \S+ at (http://127\.0\.0\.1:\d+)/v1", log.read_text())):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        yield found.group(1)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def run_client(argv: list[str], home: Path, env: dict[str, str]) -> str:
    """One client command in ``home``/project with HOME set to ``home``; its stdout."""
    project = home / "project"
    project.mkdir(parents=True, exist_ok=True)
    # PWD too: OpenCode takes its project directory (where it reads opencode.json) from it, not from the real cwd
    done = subprocess.run(argv, cwd=project, env={**os.environ, "HOME": str(home), "PWD": str(project), **env},
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, (argv, done.stdout[-2000:], done.stderr[-2000:])
    return done.stdout
