"""The sliding-window cache group on a real model: Gemma 3 (``gemma3_text``, five window layers of 12 tokens to one
global layer, tiny random weights written by transformers' save_pretrained) with prompts longer than the window.

The window layers keep their K/V in pages of their own, and a running sequence holds only those its window reads
(engine/kv/window_pool.py). To prove that no query ever reads a page it does not hold (one it released, one before
its hit's window), every page nobody holds is filled with NaN for every step: the free ones, and the cached ones
(released, still named by their blocks for later hits), whose K/V is put back after the step. One read of such a
page would turn the logits into NaN. Under that poison, greedy tokens equal transformers' one prompt at a time, all together, with the cache hot
(hits resuming on retained windows), with prefill chunks ending off block boundaries, and under preemption in small
pools of both kinds; a conversation's next turn reads all but at most one block of the previous prompt and reply.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine import LLM, SamplingParams
from engine.errors import KVCacheTooSmallError
from tests.hf_oracle import (CheckpointDirs, assert_greedy_alone_and_together, assert_greedy_cache_hot, hf_greedy,
                             random_prompts, saved_with_tokenizer)
from tests.models.test_gemma3 import VOCAB, WINDOW, hf_gemma3_model

KIND = "gemma3_text"
LENGTHS = [1, 4, 9, 17, 40, 70]
NEW_TOKENS = 8
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
BS = 4


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    path = CheckpointDirs(tmp_path_factory.mktemp("gemma3_window"), saved_with_tokenizer(hf_gemma3_model))[KIND]
    prompts = random_prompts(VOCAB, LENGTHS, seed=5)
    return path, prompts, [hf_greedy(path, p, NEW_TOKENS) for p in prompts]


def poisoned_llm(path: str, block_size: int = BS, **config) -> LLM:
    """An engine (stepping synchronously) whose window pages nobody holds are NaN during every step, in every tensor
    of the window group (a window layer's K and V, DeepSeek V4's keys); the cached ones get theirs back after the
    step."""
    llm = LLM(path, block_size=block_size, async_scheduling=False, **config)
    runner, pool = llm.engine.runner, llm.engine.scheduler.kv.window
    assert runner.window_group and pool is not None
    windowed = [t for layer in runner.kv_spec.window_layers(runner.kv_caches) for t in layer]
    execute = runner.execute

    def execute_poisoned(sched, *args, **kwargs):
        runner.run_transfers(sched.kv_transfers)  # the step's tier copies first: they read and write held pages
        sched = replace(sched, kv_transfers=[])
        free = torch.tensor(pool.free_pages, dtype=torch.long)
        cached = torch.tensor(list(pool.cached), dtype=torch.long)
        kept = [cache[cached].clone() for cache in windowed]
        for cache in windowed:
            for pages in (free, cached):
                cache[pages] = float("nan")
        try:
            return execute(sched, *args, **kwargs)
        finally:
            for cache, contents in zip(windowed, kept):
                cache[cached] = contents

    runner.execute = execute_poisoned
    return llm


@pytest.mark.slow  # the greedy test keeps the group in the fast tier
def test_window_layers_keep_pages_of_their_own(case):
    """Five window layers with a pool of their own, the global layer with the full-attention pool; a 70-token prompt
    (with a 12-token window, in 4-token blocks) leaves only its retained windows held when it ends."""
    path, prompts, expected = case
    llm = LLM(path, block_size=BS, num_kv_blocks=64, num_window_blocks=40, max_num_seqs=4)
    runner, kv = llm.engine.runner, llm.engine.scheduler.kv
    assert runner.kv_spec.layer_windows == (WINDOW[KIND],) * 5 + (None,)
    assert [k.shape[0] for k, _ in runner.kv_caches] == [40] * 5 + [64]
    assert llm.generate([prompts[-1]], GREEDY)[0].token_ids == expected[-1]
    anchored = {page for node in kv.window.anchors for page in node.window_pages}
    assert kv.window.num_free == 40 - len(anchored)
    assert len(kv.window.anchors) == 2, "the prompt end and the reply end"
    assert len(anchored) <= 2 * (-(-(WINDOW[KIND] - 1) // BS) + 1)
    kv.check_invariants()


def test_greedy_one_at_a_time_all_together_and_cache_hot(case):
    path, prompts, expected = case
    llm = poisoned_llm(path, num_kv_blocks=512, num_window_blocks=96)
    assert_greedy_alone_and_together(llm, prompts, expected)
    assert_greedy_cache_hot(llm, prompts, expected, BS)  # hot: each resumes on its prompt end's retained window


@pytest.mark.slow
def test_chunked_prefill_off_block_boundaries_and_preemption_in_small_pools(case):
    """7-token chunks (ending mid-block and mid-window) in pools of 22 full-attention blocks (the longest request and two more) and 12 window pages:
    sequences are preempted and resume on the window retained where they stopped."""
    path, prompts, expected = case
    llm = poisoned_llm(path, num_kv_blocks=22, num_window_blocks=12, max_num_batched_tokens=7)
    outs = llm.generate(prompts[::-1], GREEDY)
    assert [o.token_ids for o in outs[::-1]] == expected
    assert llm.engine.scheduler.num_preemptions > 0
    llm.engine.scheduler.kv.check_invariants()


def test_next_turn_reads_all_but_one_block_of_prompt_and_reply(case):
    path, prompts, expected = case
    llm = poisoned_llm(path, num_kv_blocks=512, num_window_blocks=64)
    first = prompts[-1]
    reply = llm.generate([first], GREEDY)[0].token_ids
    assert reply == expected[-1]
    turn = first + reply + [1234, 5678, 91011, 1213, 1415]
    out = llm.generate([turn], GREEDY)[0]
    assert out.num_cached_tokens >= len(first) + len(reply) - BS
    assert out.token_ids == hf_greedy(path, turn, NEW_TOKENS)


@pytest.mark.slow
@pytest.mark.timeout(120)  # the bug this guards against was a hang
def test_a_step_the_window_pool_can_never_hold_is_refused_and_one_that_fits_waits_its_turn(case):
    """A 6-page window pool (12-token window, 4-token blocks: 3 pages of window) and 64-token steps: the 70-token
    prompt's first step would hold 20 pages, so it is refused when it arrives, naming the numbers and the way out
    (it used to wait forever for pages no request frees). In the 9-token steps the message offers, it and the
    40-token prompt run in that pool together, one waiting for the other's pages, with transformers' greedy tokens."""
    path, prompts, expected = case
    llm = LLM(path, block_size=BS, num_kv_blocks=64, num_window_blocks=6, max_num_batched_tokens=64)
    with pytest.raises(KVCacheTooSmallError, match=r"holds up to 20 sliding-window KV pages .* window pool has 6; "
                                                   r".*--num-window-blocks.* --max-num-batched-tokens to 9 or less"):
        llm.generate([prompts[-1]], GREEDY)
    llm.close()
    llm = poisoned_llm(path, num_kv_blocks=64, num_window_blocks=6, max_num_batched_tokens=9)
    assert [o.token_ids for o in llm.generate(prompts[-2:], GREEDY)] == expected[-2:]
    llm.engine.scheduler.kv.check_invariants()


@pytest.mark.slow
def test_interleaved_sessions_keep_80_percent_of_a_dense_models_cached_tokens_in_the_same_memory(case):
    """Six agent sessions sharing a system prompt, three turns each, interleaved, through the engine with the same
    KV memory (0.86 MB: about 550 tokens of every layer) with every layer full and with the window group: the
    window model reads at least 80% of the tokens the dense one reads from its cache (measured: 3,880 against 3,464
    of 5,679 prompt tokens: 1.12x)."""
    from benchmarks.prefix.agent_sessions import SessionsParams, agent_sessions

    path, _, _ = case
    requests = agent_sessions(SessionsParams(sessions=6, turns=3, shared_tokens=200, task_tokens=60,
                                             result_tokens=(20, 60), reply_tokens=(10, 20), vocab=VOCAB))
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    cached = {}
    for window_group in (False, True):
        llm = LLM(path, block_size=BS, kv_cache_memory_gb=0.0008, max_num_seqs=1, max_num_batched_tokens=256,
                  sliding_window_cache=window_group)
        cached[window_group] = sum(llm.generate([r.prompt], one)[0].num_cached_tokens for r in requests)
        llm.engine.scheduler.kv.check_invariants()
    dense_prompts = sum(len(r.prompt) for r in requests)
    assert cached[False] < 0.7 * dense_prompts, ("the dense pool is under pressure", cached, dense_prompts)
    assert cached[True] >= 0.8 * cached[False], cached


@pytest.mark.slow
def test_sessions_pushed_off_the_device_resume_from_the_host_and_disk_tiers(case, tmp_path):
    """Three 40-token sessions, then each one's next turn, through a device pool of 16 blocks (one session and a
    bit): the earlier sessions' blocks and retained windows leave the device for the host tier (and disk), and their
    next turns resume there, all but at most one block of prompt and reply, the tokens from the host exactly those
    the cache said the host held, transformers' greedy tokens every time. Without tiers (what a sliding-window model
    got before its windows travelled) they are recomputed. After a restart the disk tier serves a whole turn."""
    path, _, _ = case
    settings = dict(num_kv_blocks=16, num_window_blocks=24, max_num_seqs=1, max_num_batched_tokens=32)
    tiers = dict(kv_offload_gb=0.0005, kv_disk_dir=str(tmp_path))
    firsts, expected, cached = random_prompts(VOCAB, [40, 40, 40], seed=12), {}, {}
    for with_tiers in (False, True):
        llm = poisoned_llm(path, **settings, **(tiers if with_tiers else {}))
        kv, hasher = llm.engine.scheduler.kv, llm.engine.scheduler.hasher
        turns = [first + llm.generate([first], GREEDY)[0].token_ids + [11, 12, 13, 14, 15] for first in firsts]
        cached[with_tiers] = []
        for turn in turns:
            where = kv.where_cached(hasher.hashes(turn, None))
            host_before = llm.stats.prefix_cache_host_hits_tokens
            out = llm.generate([turn], GREEDY)[0]
            want = expected.setdefault(tuple(turn), hf_greedy(path, turn, NEW_TOKENS))
            assert out.token_ids == want
            cached[with_tiers].append(out.num_cached_tokens)
            from_host = llm.stats.prefix_cache_host_hits_tokens - host_before
            assert from_host == BS * where[: out.num_cached_tokens // BS].count("host")
        kv.check_invariants()
        llm.close()  # with tiers: writes the device's blocks and windows through to disk
    assert all(n >= len(first) + NEW_TOKENS - BS for n, first in zip(cached[True], firsts)), cached
    assert cached[False][0] < cached[True][0] and cached[False][1] < cached[True][1], cached
    llm = poisoned_llm(path, **settings, **tiers)
    try:
        out = llm.generate([turns[0]], GREEDY)[0]
        assert out.token_ids == expected[tuple(turns[0])]
        assert out.num_cached_tokens == llm.stats.prefix_cache_disk_hits_tokens >= len(firsts[0]) + NEW_TOKENS - BS
    finally:
        llm.close()
