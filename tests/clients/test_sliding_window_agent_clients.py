"""The real agent clients against the sliding-window models (issue 37): Claude Code, Codex and OpenCode run the
session of tests/clients against `kvserve serve --model gpt-oss-tiny` (window 128 / full layers with sinks, harmony)
and `--model gemma3-tiny` (five window-16 layers to one full one, Gemma 3's template), and read as much from the
prefix cache as a dense model (qwen3-tiny) would.

As in test_hybrid_agent_clients.py, two models' runs do not send the same requests (other templates, other noise
for replies, so other client flows), so the check is request for request on the same requests: each request the
sliding-window model served (`--record`) computes at most one block more than a dense cache (the engine's KV
manager with every cached block a hit, replayed over the same prompts and replies) would have left to compute;
and the session's last request computes at most what its prompt added to the first one, plus one block. A window
model can resume a prefix only where the window's pages were kept (prompt ends, reply ends, message boundaries):
this is what shows that the points it keeps are the ones an agent comes back to.

Slow tier: one server and one two-turn session per case (8-12k-token prompts, 4-5 minutes a case on two busy
cores). CI runs one client per model, the one each is made for: Codex (Responses) against gpt-oss-tiny, Claude Code
against gemma3-tiny; the other four cases, OpenCode's among them, run with KVSERVE_HYBRID_CLIENTS=1 (the opt-in of
the hybrid test, which installs OpenCode)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.clients.harness import installed_bins, serve
from tests.clients.sessions import BLOCK, dense_uncached, last_turn_excess, opencode_bins, rows_of, session, uncached

pytestmark = pytest.mark.slow
IN_CI = {("codex", "gpt-oss-tiny"), ("claude", "gemma3-tiny")}


@pytest.mark.parametrize("model", ["gpt-oss-tiny", "gemma3-tiny"])
@pytest.mark.parametrize("client", ["claude", "codex", "opencode"])
@pytest.mark.slow
def test_sliding_window_model_reads_the_cache_as_a_dense_one(client: str, model: str, tmp_path: Path) -> None:
    if (client, model) not in IN_CI and os.environ.get("KVSERVE_HYBRID_CLIENTS") != "1":
        pytest.skip(f"{client} against {model} is in the opt-in matrix: set KVSERVE_HYBRID_CLIENTS=1 to run it")
    bins = opencode_bins() if client == "opencode" else installed_bins()
    record = tmp_path / f"{model}.jsonl"
    with serve(model, record.with_suffix(".log"), "--block-size", str(BLOCK), "--record", str(record)) as url:
        session(client, bins, url, model, tmp_path / model)
    rows = rows_of(record)
    served, dense = uncached(rows), dense_uncached(rows)
    assert len(rows) >= 2, served
    assert sum(r["cached_tokens"] for r in rows) > 0, served
    for s, d in zip(served, dense):
        assert s <= d + BLOCK, (served, dense)
    assert last_turn_excess(rows) <= BLOCK, (last_turn_excess(rows), served)
