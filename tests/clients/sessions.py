"""One agent session as tests/clients runs it, and what its recorded requests read from the prefix cache: shared by
the tests that compare a model whose cache is not a plain dense one (hybrid, sliding-window) with a dense cache."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from engine.kv.block_hashing import BlockHasher
from engine.kv.manager import KVCacheManager
from tests.clients.harness import CLIENTS, CODEX_CONFIG, clients_dir, run_client

BLOCK = 16
OPENCODE = "opencode-ai@1.18.33"
OPENCODE_CONFIG = {
    "$schema": "https://opencode.ai/config.json",
    "provider": {"kvserve": {"npm": "@ai-sdk/openai-compatible", "name": "kvserve (local)",
                             "options": {"baseURL": "{url}/v1", "apiKey": "unused"},
                             "models": {"{model}": {"name": "{model}", "limit": {"context": 40960, "output": 16}}}}},
    "model": "kvserve/{model}",
}


def opencode_bins() -> Path:
    """OpenCode beside the pinned clients, installed on first use (opt-in: KVSERVE_HYBRID_CLIENTS=1)."""
    if os.environ.get("KVSERVE_HYBRID_CLIENTS") != "1":
        pytest.skip(f"OpenCode is not among CI's pinned clients: set KVSERVE_HYBRID_CLIENTS=1 to install {OPENCODE} "
                    "and run it against qwen3.6-tiny (about 3 minutes)")
    prefix = clients_dir() / "with-opencode"
    wanted = json.dumps(sorted([*CLIENTS.values(), OPENCODE]))
    stamp = prefix / "pinned.json"
    if not (stamp.exists() and stamp.read_text() == wanted):
        prefix.mkdir(parents=True, exist_ok=True)
        subprocess.run(["npm", "install", "--prefix", str(prefix), "--no-audit", "--no-fund", *CLIENTS.values(),
                        OPENCODE], check=True, capture_output=True, timeout=900)
        stamp.write_text(wanted)
    return prefix / "node_modules" / ".bin"


def session(client: str, bins: Path, url: str, model: str, home: Path) -> tuple[str, str]:
    """Two turns of one session, as tests/clients runs them (and OpenCode as the README does): each turn's stdout."""
    if client == "claude":
        env = {"ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": "unused"}
        command = [str(bins / "claude"), "--model", model, "--output-format", "json", "-p"]
        return (run_client([*command, "What is in this directory?"], home, env),
                run_client([str(bins / "claude"), "-c", *command[1:], "And now?"], home, env))
    if client == "codex":
        (home / ".codex").mkdir(parents=True, exist_ok=True)
        (home / ".codex" / "config.toml").write_text(CODEX_CONFIG.format(url=url, model=model))
        command = [str(bins / "codex"), "exec", "--json", "--skip-git-repo-check"]
        return (run_client([*command, "What is in this directory?"], home, {"KVSERVE_API_KEY": "unused"}),
                run_client([*command, "resume", "--last", "And now?"], home, {"KVSERVE_API_KEY": "unused"}))
    config = json.dumps(OPENCODE_CONFIG).replace("{url}", url).replace("{model}", model)
    (home / "project").mkdir(parents=True, exist_ok=True)
    (home / "project" / "opencode.json").write_text(config)
    return (run_client([str(bins / "opencode"), "run", "What is in this directory?"], home, {}),
            run_client([str(bins / "opencode"), "run", "--continue", "And now?"], home, {}))


def codex_usage(stdout: str) -> dict:
    """The usage of `codex exec --json`'s completed turn (a resumed thread's: its usage so far)."""
    events = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    assert any(e["type"] == "turn.completed" for e in events), events
    return next(e["usage"] for e in events if e["type"] == "turn.completed")


def assert_turn2_read_the_cache(client: str, turns: tuple[str, str]) -> None:
    """The client's own usage report of `session`: both turns succeeded, in one session, and the second read at least
    half its prompt from the prefix cache (Claude Code and Codex; OpenCode's `run` reports no usage)."""
    if client == "claude":
        first, second = map(json.loads, turns)
        for turn in (first, second):
            assert turn["is_error"] is False and turn["subtype"] == "success", turn
        assert second["session_id"] == first["session_id"]
        usage = second["usage"]
        prompt = usage["input_tokens"] + usage["cache_read_input_tokens"] + usage["cache_creation_input_tokens"]
        assert usage["cache_read_input_tokens"] >= prompt / 2, usage
    elif client == "codex":
        first, total = map(codex_usage, turns)
        # A resumed thread reports its usage so far: the second turn is the difference.
        second_input = total["input_tokens"] - first["input_tokens"]
        second_cached = total["cached_input_tokens"] - first["cached_input_tokens"]
        assert second_input > 0 and second_cached >= second_input / 2, (first, total)


def rows_of(record: Path) -> list[dict]:
    return [json.loads(line) for line in record.read_text().splitlines()]


def uncached(rows: list[dict]) -> list[int]:
    """Per request, in order: prompt tokens the cache did not serve."""
    return [len(r["prompt_token_ids"]) - r["cached_tokens"] for r in rows]


def dense_uncached(rows: list[dict]) -> list[int]:
    """What a dense model's cache (every cached block a hit, nothing evicted) would leave to compute of the same
    requests: their prompts and replies replayed through the engine's KV manager without recurrent states."""
    ids = [r["prompt_token_ids"] + r["output_token_ids"][:-1] for r in rows]  # a reply's last token is not computed
    kv = KVCacheManager(sum(len(i) // BLOCK + 2 for i in ids), BLOCK)
    hasher = BlockHasher(BLOCK, "dense")
    left = []
    for n, (r, tokens) in enumerate(zip(rows, ids)):
        prompt, hashes = r["prompt_token_ids"], hasher.hashes(tokens, r["cache_salt"])
        left.append(len(prompt) - kv.admit(n, hashes, prompt, len(prompt)))
        kv.allocate(n, len(tokens))
        kv.commit(n, hashes, tokens, len(tokens))
        kv.free(n)
    return left


def last_turn_excess(rows: list[dict]) -> int:
    """Tokens the last request computed beyond what its prompt added to the session's first prompt."""
    added = len(rows[-1]["prompt_token_ids"]) - len(rows[0]["prompt_token_ids"])
    return uncached(rows)[-1] - added
