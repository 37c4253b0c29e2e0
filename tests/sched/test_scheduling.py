"""Chunked prefill, preemption under a tiny block pool, and n > 1 sharing the prompt's blocks."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.hf_oracle import random_prompts

LENGTHS = [3, 9, 17, 26, 40, 5]


@pytest.fixture(scope="module")
def reference(qwen3_llm: LLM):
    prompts = random_prompts(50_000, LENGTHS, seed=21)
    params = [SamplingParams(max_tokens=6 + 2 * i, temperature=0, ignore_eos=True) for i in range(len(prompts))]
    qwen3_llm.reset_prefix_cache()
    return prompts, params, [o.token_ids for o in qwen3_llm.generate(prompts, params)]


@pytest.mark.parametrize("budget", [1, 3, 7])
@pytest.mark.slow
def test_chunked_prefill_with_tiny_token_budgets(reference, budget):
    prompts, params, expected = reference
    llm = LLM("qwen3-tiny", block_size=4, num_kv_blocks=512, max_num_batched_tokens=budget)
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected


@pytest.mark.slow
def test_preemption_with_tiny_block_pool(reference):
    prompts, params, expected = reference
    # 24 blocks of 4 tokens: the longest request alone needs 14 blocks, so running all together must preempt.
    llm = LLM("qwen3-tiny", block_size=4, num_kv_blocks=24, max_num_batched_tokens=64)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == expected
    assert llm.engine.scheduler.num_preemptions > 0
    kv = llm.engine.scheduler.kv
    kv.check_invariants()
    assert kv.num_sequences == 0  # every block is back: free or cached


@pytest.mark.slow
def test_request_that_can_never_fit_is_rejected():
    llm = LLM("qwen3-tiny", block_size=4, num_kv_blocks=4)
    with pytest.raises(ValueError, match="KV blocks"):
        llm.generate([list(range(100, 130))], SamplingParams(max_tokens=2))


def test_n_siblings_share_the_prompt_blocks(qwen3_llm: LLM):
    llm = qwen3_llm
    llm.reset_prefix_cache()
    engine = llm.engine
    (prompt,) = random_prompts(50_000, [22], seed=22)
    engine.add_request("n4", prompt, SamplingParams(max_tokens=5, n=4, temperature=1.0, seed=7, ignore_eos=True))
    computed_before = engine.stats().prompt_tokens
    engine.step()  # the leader's prompt is scheduled, so the siblings queue behind it and hit its blocks at once
    scheduler = engine.scheduler
    siblings = [scheduler.sequences["n4" if i == 0 else f"n4#{i}"] for i in range(4)]
    tables = [scheduler.kv.block_table(s.seq_id) for s in siblings]
    full_blocks = len(prompt) // 4
    assert all(t[:full_blocks] == tables[0][:full_blocks] for t in tables)
    assert len({t[full_blocks] for t in tables}) == 4  # the partial last block is each sibling's own
    assert [s.num_cached_tokens for s in siblings] == [0] + [full_blocks * 4] * 3
    # The prompt is computed once; each sibling only recomputes its partial last block.
    assert engine.stats().prompt_tokens - computed_before == len(prompt) + 3 * (len(prompt) - full_blocks * 4)
    scheduler.kv.check_invariants()
    while engine.has_unfinished_requests():
        engine.step()
    out = llm.generate([prompt], SamplingParams(max_tokens=5, n=4, temperature=1.0, seed=7, ignore_eos=True))[0]
    assert len(out.outputs) == 4 and all(len(c.token_ids) == 5 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # siblings sample independently
    again = llm.generate([prompt], SamplingParams(max_tokens=5, n=4, temperature=1.0, seed=7, ignore_eos=True))[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
