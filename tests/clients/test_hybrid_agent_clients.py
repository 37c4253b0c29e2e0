"""The real agent clients against a hybrid model: OpenCode, Claude Code and Codex run the same two-turn session
against `kvserve serve --model qwen3.6-tiny` (Gated DeltaNet + gated attention: a prefix is resumable only where a
recurrent-state snapshot exists) and against `--model qwen3-tiny` (a dense model: every cached block is a hit).
The clients' request flows depend on the replies (noise from random weights), so the two runs need not send the
same requests: request for request (`--record`), the hybrid model leaves at most one block more of each prompt to
compute than a dense cache would on the very same requests (the engine's KV manager without states, replayed), and
its last turn at most one block more than the dense model's last turn. The snapshot policy (message-boundary hints,
prompt end, reply end) loses nothing an agent reuses. Slow: six servers and six agent sessions of 8-12k-token
prompts on CPU."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from engine.block_hashing import BlockHasher
from engine.kv_cache import KVCacheManager
from tests.clients.test_agent_clients import CLIENTS, CODEX_CONFIG, GRAMMAR_WAIT, _run, clients_dir

# About 5 minutes per client on two cores: run on demand (KVSERVE_HYBRID_CLIENTS=1), not in every suite run.
pytestmark = [pytest.mark.slow, pytest.mark.skipif(os.environ.get("KVSERVE_HYBRID_CLIENTS") != "1",
                                                   reason="set KVSERVE_HYBRID_CLIENTS=1 to run the agents against "
                                                          "qwen3.6-tiny (about 5 minutes per client)")]
BLOCK = 16
OPENCODE = "opencode-ai@1.18.33"
OPENCODE_CONFIG = {
    "$schema": "https://opencode.ai/config.json",
    "provider": {"kvserve": {"npm": "@ai-sdk/openai-compatible", "name": "kvserve (local)",
                             "options": {"baseURL": "{url}/v1", "apiKey": "unused"},
                             "models": {"{model}": {"name": "{model}", "limit": {"context": 40960, "output": 16}}}}},
    "model": "kvserve/{model}",
}


@pytest.fixture(scope="module")
def bins() -> Path:
    """Claude Code, Codex (the pinned versions of tests/clients) and OpenCode, installed on first use."""
    prefix = clients_dir() / "with-opencode"
    wanted = json.dumps(sorted([*CLIENTS.values(), OPENCODE]))
    stamp = prefix / "pinned.json"
    if not (stamp.exists() and stamp.read_text() == wanted):
        prefix.mkdir(parents=True, exist_ok=True)
        subprocess.run(["npm", "install", "--prefix", str(prefix), "--no-audit", "--no-fund", *CLIENTS.values(),
                        OPENCODE], check=True, capture_output=True, timeout=900)
        stamp.write_text(wanted)
    return prefix / "node_modules" / ".bin"


@contextmanager
def serve(model: str, record: Path) -> Iterator[str]:
    log = record.with_suffix(".log")
    with log.open("w") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "server.cli", "serve", "--model", model, "--port", "0", "--max-model-len", "40960",
             "--max-output-tokens", "16", "--num-kv-blocks", "8192", "--block-size", str(BLOCK), "--record",
             str(record), "--log-level", "warning", *GRAMMAR_WAIT],
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


def _session(client: str, bins: Path, url: str, model: str, home: Path) -> None:
    """Two turns of one session, as tests/clients runs them (and OpenCode as the README does)."""
    if client == "claude":
        env = {"ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": "unused"}
        command = [str(bins / "claude"), "--model", model, "--output-format", "json", "-p"]
        _run([*command, "What is in this directory?"], home, env)
        _run([str(bins / "claude"), "-c", *command[1:], "And now?"], home, env)
    elif client == "codex":
        (home / ".codex").mkdir(parents=True, exist_ok=True)
        (home / ".codex" / "config.toml").write_text(CODEX_CONFIG.format(url=url).replace("qwen3-tiny", model))
        command = [str(bins / "codex"), "exec", "--json", "--skip-git-repo-check"]
        _run([*command, "What is in this directory?"], home, {"KVSERVE_API_KEY": "unused"})
        _run([*command, "resume", "--last", "And now?"], home, {"KVSERVE_API_KEY": "unused"})
    else:
        config = json.dumps(OPENCODE_CONFIG).replace("{url}", url).replace("{model}", model)
        (home / "project").mkdir(parents=True, exist_ok=True)
        (home / "project" / "opencode.json").write_text(config)
        _run([str(bins / "opencode"), "run", "What is in this directory?"], home, {})
        _run([str(bins / "opencode"), "run", "--continue", "And now?"], home, {})


def _rows(record: Path) -> list[dict]:
    return [json.loads(line) for line in record.read_text().splitlines()]


def _uncached(rows: list[dict]) -> list[int]:
    """Per request, in order: prompt tokens the cache did not serve."""
    return [len(r["prompt_token_ids"]) - r["cached_tokens"] for r in rows]


def _dense_uncached(rows: list[dict]) -> list[int]:
    """What a dense model's cache (every cached block a hit, nothing evicted) would leave to compute of the same
    requests: their prompts and replies replayed through the engine's KV manager without recurrent states."""
    ids = [r["prompt_token_ids"] + r["output_token_ids"][:-1] for r in rows]  # a reply's last token is not computed
    kv = KVCacheManager(sum(len(i) // BLOCK + 2 for i in ids), BLOCK)
    hasher = BlockHasher(BLOCK, "dense")
    uncached = []
    for n, (r, tokens) in enumerate(zip(rows, ids)):
        prompt, hashes = r["prompt_token_ids"], hasher.hashes(tokens, r["cache_salt"])
        uncached.append(len(prompt) - kv.admit(n, hashes, prompt, len(prompt)))
        kv.allocate(n, len(tokens))
        kv.commit(n, hashes, tokens, len(tokens))
        kv.free(n)
    return uncached


# Measured 2026-12-01: Codex and OpenCode pass (OpenCode once tests/clients set PWD); Claude Code's retry request (one
# more content part on its first user message) reads 144 tokens less than a dense cache would, kept here as the check
# to pass (docs/HYBRID_CACHE.md says why and what would fix it).
@pytest.mark.parametrize("client", ["codex", "claude", "opencode"])
def test_hybrid_model_reads_the_cache_as_the_dense_one(client: str, bins: Path, tmp_path: Path) -> None:
    rows = {}
    for model in ("qwen3-tiny", "qwen3.6-tiny"):
        record = tmp_path / f"{model}.jsonl"
        with serve(model, record) as url:
            _session(client, bins, url, model, tmp_path / model)
        rows[model] = _rows(record)
    hybrid, dense = _uncached(rows["qwen3.6-tiny"]), _uncached(rows["qwen3-tiny"])
    same_requests_dense = _dense_uncached(rows["qwen3.6-tiny"])
    assert len(hybrid) >= 2 and len(dense) >= 2, (hybrid, dense)
    for h, d in zip(hybrid, same_requests_dense):
        assert h <= d + BLOCK, (hybrid, same_requests_dense)
    assert hybrid[-1] <= dense[-1] + BLOCK, (hybrid, dense)  # the second turn, as against qwen3-tiny
