"""Greedy tokens and final-position log-probabilities equal HF transformers on the same weights: dense, MoE and
MLA models (DeepSeek-V3.2's sparse MLA too), cold and with the prefix cache hot."""
from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from tests.hf_oracle import hf_greedy, hf_model, new_llm, random_prompts

LENGTHS = [1, 3, 4, 5, 8, 15, 16, 17, 33, 64]
NEW_TOKENS = 10


@pytest.fixture(scope="module", params=["qwen3-tiny", "deepseek-tiny", "smollm2-135m", "qwen3-moe-tiny",
                                        "deepseek-v3-tiny",
                                        pytest.param("deepseek-v3.2-tiny", marks=pytest.mark.slow)])
def model_case(request):
    name = request.param
    llm = new_llm(name, block_size=4, num_kv_blocks=1024, max_num_batched_tokens=256)
    prompts = random_prompts(llm.engine.model_cfg.vocab_size, LENGTHS, seed=len(name))
    expected = [hf_greedy(name, p, NEW_TOKENS) for p in prompts]
    return name, llm, prompts, expected


@pytest.mark.slow
def test_tiny_model_outputs_are_varied(model_case):
    _, _, _, expected = model_case
    assert len({tuple(e) for e in expected}) >= len(expected) - 1, "different prompts must continue differently"
    assert sum(len(set(e)) for e in expected) > 2 * len(expected), "continuations must not repeat one token"


@pytest.mark.slow
def test_greedy_one_at_a_time(model_case):
    _, llm, prompts, expected = model_case
    llm.reset_prefix_cache()
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    for prompt, want in zip(prompts, expected):
        assert llm.generate([prompt], greedy)[0].token_ids == want


@pytest.mark.slow
def test_greedy_all_together_mixed_finish_times(model_case):
    _, llm, prompts, expected = model_case
    llm.reset_prefix_cache()
    params = [SamplingParams(max_tokens=1 + (3 * i) % NEW_TOKENS, temperature=0, ignore_eos=True) for i in range(len(prompts))]
    outs = llm.generate(prompts, params)
    for out, want, p in zip(outs, expected, params):
        assert out.token_ids == want[: p.max_tokens]
        assert out.finish_reason == "length"


@pytest.mark.fast_cases("qwen3-tiny", "deepseek-tiny")
def test_greedy_with_prefix_cache_hot(model_case):
    _, llm, prompts, expected = model_case
    llm.reset_prefix_cache()
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    llm.generate(prompts, SamplingParams(max_tokens=1))  # caches every prompt's full blocks
    outs = llm.generate(prompts, greedy)
    # everything but the last block (block_size 4) of each prompt comes from the cache
    assert [o.num_cached_tokens for o in outs] == [(len(p) - 1) // 4 * 4 for p in prompts]
    assert [o.token_ids for o in outs] == expected


@pytest.mark.fast_cases("qwen3-tiny", "deepseek-tiny", "qwen3-moe-tiny")
def test_final_position_logprobs_match(model_case):
    name, llm, prompts, _ = model_case
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0, logprobs=20))
    model = hf_model(name)
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0, -1].float(), -1)
        top = out.outputs[0].logprobs[0].top
        ids = torch.tensor([t for t, _ in top])
        got = torch.tensor([lp for _, lp in top])
        torch.testing.assert_close(got, ref[ids], atol=2e-4, rtol=1e-4)
        assert ids[0].item() == int(ref.argmax())
