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


def session(client: str, bins: Path, url: str, model: str, home: Path) -> None:
    """Two turns of one session, as tests/clients runs them (and OpenCode as the README does)."""
    if client == "claude":
        env = {"ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": "unused"}
        command = [str(bins / "claude"), "--model", model, "--output-format", "json", "-p"]
        run_client([*command, "What is in this directory?"], home, env)
        run_client([str(bins / "claude"), "-c", *command[1:], "And now?"], home, env)
    elif client == "codex":
        (home / ".codex").mkdir(parents=True, exist_ok=True)
        (home / ".codex" / "config.toml").write_text(CODEX_CONFIG.format(url=url, model=model))
        command = [str(bins / "codex"), "exec", "--json", "--skip-git-repo-check"]
        run_client([*command, "What is in this directory?"], home, {"KVSERVE_API_KEY": "unused"})
        run_client([*command, "resume", "--last", "And now?"], home, {"KVSERVE_API_KEY": "unused"})
    else:
        config = json.dumps(OPENCODE_CONFIG).replace("{url}", url).replace("{model}", model)
        (home / "project").mkdir(parents=True, exist_ok=True)
        (home / "project" / "opencode.json").write_text(config)
        run_client([str(bins / "opencode"), "run", "What is in this directory?"], home, {})
        run_client([str(bins / "opencode"), "run", "--continue", "And now?"], home, {})


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
