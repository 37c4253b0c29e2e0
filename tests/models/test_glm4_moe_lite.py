"""GLM-4.7-Flash (``glm4_moe_lite``: DeepSeek-V3's MLA and MoE with one expert group, wider q/k and v heads than
DeepSeek's) equals transformers' ``Glm4MoeLiteForCausalLM`` on ``glm4.7-flash-tiny``: greedy tokens one at a time,
together, with the prefix cache hot, in chunks off block boundaries under preemption, and top-20 logprobs within 1e-4
in fp32; its tokens spread over every expert."""
from __future__ import annotations

from collections import Counter

import pytest

from engine import LLM, SamplingParams
from tests.hf_oracle import assert_top_logprobs_equal_hf, hf_greedy, random_prompts
from tests.models.test_moe_mla_models import _routed_experts

NAME = "glm4.7-flash-tiny"
NEW_TOKENS = 8
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
VOCAB = 150_000  # ordinary text ids of the stand-in tokenizer


@pytest.fixture(scope="module")
def cases() -> tuple[LLM, list[list[int]], list[list[int]]]:
    llm = LLM(NAME, block_size=4, num_kv_blocks=512, max_num_batched_tokens=256)
    prompts = random_prompts(VOCAB, [1, 4, 7, 16, 29], seed=38)
    return llm, prompts, [hf_greedy(NAME, p, NEW_TOKENS) for p in prompts]


def test_outputs_are_varied(cases) -> None:
    _, _, expected = cases
    assert len({tuple(e) for e in expected}) == len(expected)
    assert sum(len(set(e)) for e in expected) > 3 * len(expected)


def test_greedy_one_at_a_time_and_together(cases) -> None:
    llm, prompts, expected = cases
    llm.reset_prefix_cache()
    assert [llm.generate([p], GREEDY)[0].token_ids for p in prompts] == expected
    llm.reset_prefix_cache()
    params = [SamplingParams(max_tokens=2 + i, temperature=0, ignore_eos=True) for i in range(len(prompts))]
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [e[: p.max_tokens] for e, p in zip(expected, params)]


def test_greedy_with_prefix_cache_hot(cases) -> None:
    llm, prompts, expected = cases
    llm.reset_prefix_cache()
    llm.generate(prompts, SamplingParams(max_tokens=1))
    outs = llm.generate(prompts, GREEDY)
    assert [o.num_cached_tokens for o in outs] == [(len(p) - 1) // 4 * 4 for p in prompts]
    assert [o.token_ids for o in outs] == expected


@pytest.mark.slow  # ~6 s; the config sweep's glm4_moe_lite draws chunk and preempt too (slow tier)
def test_chunked_prefill_off_block_boundaries_with_preemption() -> None:
    """7 tokens a step (chunks end mid-block) in a pool of 20 blocks of 4: prefills run beside decodes, some after a
    cached prefix, and running requests are preempted and recomputed."""
    base = random_prompts(VOCAB, [10], seed=21)[0]
    prompts = [base + tail for tail in random_prompts(VOCAB, [9, 19], seed=22)] + random_prompts(VOCAB, [26, 13],
                                                                                               seed=23)
    llm = LLM(NAME, block_size=4, num_kv_blocks=20, max_num_batched_tokens=7)
    llm.generate([base], SamplingParams(max_tokens=1))  # caches base's two full blocks
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert outs[0].num_cached_tokens == 8
    assert llm.stats.preemptions > 0
    assert [o.token_ids for o in outs] == [hf_greedy(NAME, p, params.max_tokens) for p in prompts]


def test_top20_logprobs_within_1e_4(cases) -> None:
    llm, prompts, _ = cases
    llm.reset_prefix_cache()
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0, logprobs=20))
    for prompt, out in zip(prompts, outs):
        assert_top_logprobs_equal_hf(NAME, prompt, out.outputs[0].logprobs[0].top, atol=1e-4)


def test_tokens_are_routed_to_every_expert(cases) -> None:
    llm, _, _ = cases
    moe = llm.engine.model_cfg.moe
    assert (moe.n_group, moe.scoring, moe.correction_bias, moe.routed_scaling_factor) == (1, "sigmoid", True, 1.8)
    load = Counter(_routed_experts(llm, random_prompts(VOCAB, [9, 14, 20], seed=5)).flatten().tolist())
    assert set(load) == set(range(moe.num_experts))


@pytest.mark.slow
def test_tensor_parallel_2_gives_one_ranks_tokens(cases) -> None:
    """Heads, the MoE's experts (sliced) and the vocabulary split over two gloo ranks; the latent cache replicated."""
    _, prompts, expected = cases
    with LLM(NAME, block_size=4, num_kv_blocks=128, max_num_batched_tokens=16, tensor_parallel_size=2) as llm:
        outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == expected
