"""The sliding-window policies simulated on the same requests (benchmarks/prefix/policies/sliding_window.py): kvserve's window
group against vLLM's sliding-window manager and llama.cpp's SWA cache, the memory a window group saves on the
released shapes, and the window group against a dense model in the same memory on interleaved agent sessions."""
from __future__ import annotations

import pytest

from benchmarks.prefix.agent_sessions import SessionsParams, agent_sessions
from benchmarks.prefix.policies.sliding_window import SHAPES, compare, run_kvserve, run_llama_cpp, under_pressure

KIB = 1024


@pytest.fixture(scope="module")
def sessions():
    return agent_sessions(SessionsParams(sessions=8, turns=4))


def test_bytes_per_token_of_the_released_shapes():
    """A 100k-token session, every layer full against the window group (its running window included)."""
    want = {"Gemma 3 27B": (496.0, 84.4), "Gemma-4-31B": (880.0, 88.4), "Gemma-4-26B-A4B": (220.0, 22.1),
            "Gemma-4-E2B": (18.0, 6.1), "Gemma-4-E4B": (56.0, 16.2), "Muse-Glimmer-30B": (52.0, 13.8),
            "gpt-oss-20b": (48.0, 24.0)}
    for name, (dense, group) in want.items():
        shape = SHAPES[name]
        assert shape.dense_bytes_per_token / KIB == dense
        assert round(shape.session_bytes_per_token(100_000) / KIB, 1) == group


def test_the_window_group_keeps_80_percent_of_a_dense_models_hits_in_the_same_memory(sessions):
    """Eight interleaved sessions (4 turns of 750-2,000 tokens) in pools that keep part of them (the dense model
    reads 58-80% of the 82% it reads unbounded): Gemma 3 27B's memory split (1/6 of a token's bytes in its global
    layers) with its 1024-token window and with gpt-oss' 128-token one."""
    for window in (1024, 128):
        for blocks in (200, 300, 400):
            dense, windowed = under_pressure(sessions, blocks, window, SHAPES["Gemma 3 27B"].full_share)
            assert dense.hit_rate < 0.8, "the dense pool is under pressure"
            assert windowed.cached_tokens >= 0.8 * dense.cached_tokens, (window, blocks)


def test_kvserve_reads_at_least_the_others_at_no_more_memory_with_a_small_window(sessions):
    """gpt-oss' 128-token window: kvserve reads at least vLLM (which loses the windows at the branch points and
    the replies' ends to least-recently-freed eviction in a small pool) and llama.cpp (whose slots never share)."""
    runs = {(run.policy, run.pages): run for run in compare(sessions, 128, (32, 128))}
    for pages in (32, 128):
        kvserve = runs[("kvserve", pages)]
        vllm = runs[("vLLM (drop out-of-window blocks, retention interval 0)", pages)]
        assert kvserve.hit_rate >= vllm.hit_rate and kvserve.peak_window_tokens <= vllm.peak_window_tokens
    llama = runs[("llama.cpp (3 SWA checkpoints)", 0)]
    assert runs[("kvserve", 32)].hit_rate > llama.hit_rate + 0.1
    assert runs[("kvserve", 32)].hit_rate > runs[("vLLM (drop out-of-window blocks, retention interval 0)", 32)].hit_rate


def test_swa_full_reads_every_common_prefix_and_the_swa_cache_only_its_end(sessions):
    """llama.cpp: --swa-full resumes any common prefix with its slot; without it a request resumes only at its slot's
    end or a prompt-end checkpoint, never more."""
    full, swa = run_llama_cpp(sessions, 128, swa_full=True), run_llama_cpp(sessions, 128, swa_full=False)
    assert all(s <= f for s, f in zip(swa.per_request, full.per_request))
    group = run_kvserve(sessions, 128, 1024)
    assert group.hit_rate >= full.hit_rate  # sessions share their system prompt only in kvserve's cache


def test_a_host_tier_brings_back_the_windows_a_small_pool_loses(sessions):
    """The same sessions in a 200-block pool over a host tier twice its size, split as the runner splits it: with
    gpt-oss' 128-token window the retained windows travel with their blocks and come back (62% -> 82%, what the
    dense model reads over the same tier); a 1024-token window's rows are 8x larger, so the tier holds few: it
    helps less, never hurts."""
    full_share = SHAPES["Gemma 3 27B"].full_share
    _, device_only = under_pressure(sessions, 200, 128, full_share)
    dense, windowed = under_pressure(sessions, 200, 128, full_share, host_blocks=400)
    assert windowed.hit_rate > device_only.hit_rate + 0.1
    assert windowed.cached_tokens >= 0.95 * dense.cached_tokens
    _, device_only = under_pressure(sessions, 200, 1024, full_share)
    _, windowed = under_pressure(sessions, 200, 1024, full_share, host_blocks=400)
    assert windowed.cached_tokens >= device_only.cached_tokens
