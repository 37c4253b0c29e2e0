"""The KV tiers and retention through the real engine: a session evicted by another comes back from the host pool
(or, after a restart, from disk) with the same greedy output; a pinned prefix survives pressure without any tier;
a session held across a tool call survives it."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.retention import CachePin, Retention
from tests.hf_oracle import random_prompts

BLOCK = 16
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(151_000, [960, 1440, 800], seed=11)  # A ~60 blocks, B ~90 blocks, C ~50 blocks


def aba(llm: LLM, a: list[int], b: list[int]):
    first = llm.generate([a], GREEDY)[0]
    llm.generate([b], GREEDY)
    return first, llm.generate([a], GREEDY)[0]


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.slow
def test_host_tier_brings_an_evicted_session_back(prompts, async_scheduling):
    a, b, _ = prompts
    llm = LLM("qwen3-tiny", block_size=BLOCK, num_kv_blocks=96, kv_offload_gb=0.05,
              async_scheduling=async_scheduling)
    try:
        first, third = aba(llm, a, b)
        assert third.num_cached_tokens >= 0.8 * len(a)
        assert third.token_ids == first.token_ids
        stats = llm.stats
        assert stats.prefix_cache_host_hits_tokens > 0 and stats.kv_restore_bytes > 0 and stats.kv_offload_bytes > 0
    finally:
        llm.close()


@pytest.mark.slow
def test_without_a_tier_the_session_is_recomputed(prompts):
    a, b, _ = prompts
    llm = LLM("qwen3-tiny", block_size=BLOCK, num_kv_blocks=96)
    first, third = aba(llm, a, b)
    assert third.num_cached_tokens <= 0.1 * len(a) and third.token_ids == first.token_ids


@pytest.mark.parametrize("pin", [True, False])
@pytest.mark.slow
def test_pinned_prefix_outlives_newer_sessions_without_a_tier(prompts, pin):
    """A, then sessions B and C: plain LRU evicts A (the oldest) entirely; a breakpoint after A's first 400 tokens
    (its "system prompt") keeps that prefix, evicting B's blocks instead."""
    a, b, c = prompts
    llm = LLM("qwen3-tiny", block_size=BLOCK, num_kv_blocks=96)
    llm.generate([a], GREEDY, retention=Retention((CachePin(400, 300.0),)) if pin else None)
    llm.generate([b[:800]], GREEDY)
    llm.generate([c[:960]], GREEDY)
    assert llm.generate([a], GREEDY)[0].num_cached_tokens == (400 // BLOCK * BLOCK if pin else 0)


@pytest.mark.parametrize("held", [True, False])
@pytest.mark.slow
def test_session_held_across_a_tool_call(prompts, held):
    a, b, c = prompts
    llm = LLM("qwen3-tiny", block_size=BLOCK, num_kv_blocks=96, tool_call_ttl=30.0, max_retained_fraction=0.7)
    first = llm.generate([a], GREEDY, retention=Retention(hold_after_finish_s=1.0) if held else None)[0]
    if held:
        assert llm.engine.scheduler._held  # remembered until the caller decides
        llm.engine.settle_hold(first.request_id, llm.engine.cfg.tool_call_ttl)  # the reply ended in tool calls:
        # hold A for the engine's tool_call_ttl (30 s), as the server does
    llm.generate([b[:480]], GREEDY)  # fits beside A
    llm.generate([c[:480]], GREEDY)  # needs room: plain LRU evicts A (the oldest) first; with the hold, B goes
    cached = llm.generate([a], GREEDY)[0].num_cached_tokens
    assert cached == (len(a) - 1) // BLOCK * BLOCK if held else cached < 0.7 * len(a)


@pytest.mark.slow
def test_disk_tier_survives_a_restart(prompts, tmp_path):
    a, b, c = prompts
    settings = dict(block_size=BLOCK, num_kv_blocks=96, kv_offload_gb=0.01, kv_disk_dir=str(tmp_path))
    llm = LLM("qwen3-tiny", **settings)
    cold = llm.generate([a], GREEDY)[0]
    llm.generate([c], GREEDY)
    llm.close()  # writes the device-cached blocks through to disk
    llm = LLM("qwen3-tiny", **settings)
    try:
        warm = llm.generate([a], GREEDY)[0]
        assert warm.num_cached_tokens == (len(a) - 1) // BLOCK * BLOCK
        assert warm.token_ids == cold.token_ids
        assert llm.stats.prefix_cache_disk_hits_tokens == warm.num_cached_tokens
    finally:
        llm.close()


@pytest.mark.slow
def test_a_corrupt_block_file_is_dropped_at_startup(prompts, tmp_path):
    a, _, _ = prompts
    settings = dict(block_size=BLOCK, num_kv_blocks=96, kv_offload_gb=0.01, kv_disk_dir=str(tmp_path))
    llm = LLM("qwen3-tiny", **settings)
    llm.generate([a], GREEDY)
    llm.close()
    first_block = llm.engine.scheduler.hasher.hashes(a, None)[0]
    path = llm.engine.runner.kv_offload.disk.path(first_block)
    path.write_bytes(path.read_bytes()[:-1] + b"\0")  # flip the last byte of the first block's payload
    llm = LLM("qwen3-tiny", **settings)
    try:
        assert llm.generate([a], GREEDY)[0].num_cached_tokens == 0  # the chain starts at the dropped block
        assert not path.exists()
    finally:
        llm.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_host_tier_on_cuda_side_stream_with_cuda_graphs(prompts, tmp_path):
    """On CUDA the copies run on a side stream into pinned memory, around async scheduling and decode graphs; the
    restored session and the disk tier give the same greedy tokens as a cold run."""
    a, b, _ = prompts
    llm = LLM("qwen3-tiny", block_size=BLOCK, num_kv_blocks=96, kv_offload_gb=0.05, kv_disk_dir=str(tmp_path),
              device="cuda")
    try:
        first, third = aba(llm, a, b)
        assert third.num_cached_tokens >= 0.8 * len(a) and third.token_ids == first.token_ids
        stats = llm.stats
        assert stats.kv_restore_bytes > 0 and stats.kv_disk_write_bytes > 0 and stats.kv_restore_seconds > 0
    finally:
        llm.close()
