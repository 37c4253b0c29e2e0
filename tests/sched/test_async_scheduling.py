"""Async scheduling (the host prepares step N+1 while step N runs) gives exactly the tokens of the synchronous step,
on a mixed batch that chunks prefills, preempts, samples with seeds and penalties, stops on strings and forks n > 1."""
from __future__ import annotations

from engine import LLM, SamplingParams
from tests.hf_oracle import random_prompts

LENGTHS = [3, 9, 17, 26, 40, 5, 12, 31]


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=1.0, seed=11, ignore_eos=True, logprobs=3),
        SamplingParams(max_tokens=14, temperature=0.8, top_k=20, top_p=0.9, seed=5, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0, repetition_penalty=1.3, frequency_penalty=0.5, ignore_eos=True),
        SamplingParams(max_tokens=7, temperature=1.2, seed=3, n=2, ignore_eos=True),
        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop_token_ids=[7]),
        SamplingParams(max_tokens=11, temperature=0.7, seed=9, presence_penalty=0.4, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0),
    ]


def _run(async_scheduling: bool) -> tuple[list, list, LLM]:
    # 24 blocks of 4 tokens and 16 tokens a step: prefills are chunked and running sequences get preempted.
    llm = LLM("qwen3-tiny", block_size=4, num_kv_blocks=24, max_num_batched_tokens=16,
              async_scheduling=async_scheduling)
    outs = llm.generate(random_prompts(50_000, LENGTHS, seed=31), _params())
    tokens = [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outs]
    logprobs = [lp for o in outs for c in o.outputs for lp in c.logprobs if lp is not None]
    return tokens, logprobs, llm


def test_overlap_gives_the_synchronous_tokens_with_preemption():
    sync_outputs, sync_logprobs, sync_llm = _run(async_scheduling=False)
    async_outputs, async_logprobs, async_llm = _run(async_scheduling=True)
    assert async_outputs == sync_outputs
    # Logprobs agree up to float noise: a sequence that stopped is still computed in the step already launched,
    # so some batches differ in shape (and in the order their rows reduce).
    assert [lp.top and [t for t, _ in lp.top] for lp in async_logprobs] == [
        lp.top and [t for t, _ in lp.top] for lp in sync_logprobs]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(async_logprobs, sync_logprobs)) < 1e-5
    for llm in (sync_llm, async_llm):
        assert llm.stats.preemptions > 0  # the pool really was too small for everyone at once
        llm.engine.scheduler.kv.check_invariants()
        assert llm.engine.scheduler.kv.num_sequences == 0
    # The overlap really happened: decode inputs came from the device before the host saw the previous tokens.
    assert async_llm.engine.runner.inputs.tokens_from_device > 0
    assert sync_llm.engine.runner.inputs.tokens_from_device == 0
    # Varied, context-dependent outputs: the equality above is not one repeated token.
    assert len({tuple(o[0][0]) for o in sync_outputs}) == len(LENGTHS)
