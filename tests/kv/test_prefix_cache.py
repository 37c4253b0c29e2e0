"""The prefix cache through the engine: exact hit lengths, multi-turn reuse, salts, and outputs never changed."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.hf_oracle import random_prompts

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.mark.slow
def test_shared_prefix_reports_block_aligned_length(qwen3_llm: LLM):
    llm = qwen3_llm
    llm.reset_prefix_cache()
    (first,) = random_prompts(50_000, [37], seed=11)
    assert llm.generate([first], GREEDY)[0].num_cached_tokens == 0
    for shared in (1, 4, 7, 30, 36):
        second = first[:shared] + [9_999] * 6
        out = llm.generate([second], GREEDY)[0]
        assert out.num_cached_tokens == shared // 4 * 4, shared


def test_multi_turn_conversation_hits_its_reply(qwen3_llm: LLM):
    llm = qwen3_llm
    llm.reset_prefix_cache()
    (turn1,) = random_prompts(50_000, [21], seed=12)
    reply = llm.generate([turn1], GREEDY)[0].token_ids
    turn2 = turn1 + reply + [777, 778, 779]
    out = llm.generate([turn2], GREEDY)[0]
    # Every token of turn 1 and the reply has K/V in pages except the reply's last (sampled, never fed back).
    assert out.num_cached_tokens == (len(turn1) + len(reply) - 1) // 4 * 4
    assert out.num_cached_tokens > len(turn1)  # the reply itself was reused


@pytest.mark.slow
def test_cache_on_and_off_give_identical_outputs(qwen3_llm: LLM):
    on = qwen3_llm
    off = LLM("qwen3-tiny", block_size=4, num_kv_blocks=2048, enable_prefix_caching=False)
    base = random_prompts(50_000, [30], seed=13)[0]
    tails = random_prompts(50_000, [1, 5, 9, 13], seed=14)
    prompts = [base + t for t in tails] + [base[:17], base]
    on.reset_prefix_cache()
    on.generate([base], GREEDY)  # warm the cache so the batch below really hits it
    warm = on.generate(prompts, GREEDY)
    cold = off.generate(prompts, GREEDY)
    assert [o.token_ids for o in warm] == [o.token_ids for o in cold]
    assert sum(o.num_cached_tokens for o in warm) > 0
    assert all(o.num_cached_tokens == 0 for o in cold)


def test_different_salt_never_hits(qwen3_llm: LLM):
    llm = qwen3_llm
    llm.reset_prefix_cache()
    (prompt,) = random_prompts(50_000, [25], seed=15)
    llm.generate([prompt], GREEDY, cache_salt="tenant-a")
    assert llm.generate([prompt], GREEDY, cache_salt="tenant-b")[0].num_cached_tokens == 0
    assert llm.generate([prompt], GREEDY)[0].num_cached_tokens == 0
    assert llm.generate([prompt], GREEDY, cache_salt="tenant-a")[0].num_cached_tokens == 24


@pytest.mark.slow
def test_counters_track_queries_and_hits(qwen3_llm: LLM):
    llm = qwen3_llm
    llm.reset_prefix_cache()
    before = (llm.cache_stats.queries, llm.cache_stats.hits)
    (prompt,) = random_prompts(50_000, [18], seed=16)
    llm.generate([prompt], GREEDY)
    llm.generate([prompt], GREEDY)
    assert llm.cache_stats.queries - before[0] == 36
    assert llm.cache_stats.hits - before[1] == 16
