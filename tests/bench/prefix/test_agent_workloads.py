"""Claude Code- and Codex-shaped workloads go through the server's adapters, and the miss attribution names the
causes the cache-stability rules remove."""
from __future__ import annotations

import pytest

from benchmarks.prefix.traces.render import load_model_text, normalization_change, tokenize_workload
from benchmarks.prefix.catalog import build_workloads
from benchmarks.prefix.workloads import ChatRequest, WorkloadParams
from server.cache.miss_causes import CHANGE_BILLING_NONCE, CHANGE_REASONING, CHANGE_SYSTEM_HOISTED
from server.rendering import get_renderer

SMALL = WorkloadParams(head_words=120, tasks=2, steps_per_task=2, result_words=(10, 30), reasoning_words=(5, 10))


@pytest.mark.slow
def test_claude_code_raw_misses_on_the_billing_nonce_and_the_rules_remove_it() -> None:
    mt = load_model_text("qwen3-tiny")
    normalized, raw, codex = build_workloads(["claude_code", "claude_code_raw", "codex"], SMALL)
    raw_changes = [r.change for r in tokenize_workload(raw, mt)[1:]]
    assert raw_changes and set(raw_changes) == {CHANGE_BILLING_NONCE}
    for workload in (normalized, codex):
        # Append-only, but for what Qwen3's own template does (it drops reasoning before the last user turn).
        assert {r.change for r in tokenize_workload(workload, mt)} <= {None, CHANGE_REASONING}


def test_a_new_mid_conversation_system_message_is_named_on_hoisting_templates() -> None:
    reply = {"role": "assistant", "content": "ok"}
    parent = ChatRequest("s/0", "s", [{"role": "system", "content": "head"}, {"role": "user", "content": "a"}],
                         None, reply, normalize=False)
    child = ChatRequest("s/1", "s", [*parent.messages, reply, {"role": "system", "content": "env"},
                                     {"role": "user", "content": "b"}], None, reply, parent="s/0", normalize=False)
    assert normalization_change(parent, child, get_renderer("deepseek-v3.1")) == CHANGE_SYSTEM_HOISTED
    assert normalization_change(parent, child, get_renderer("qwen3")) is None
