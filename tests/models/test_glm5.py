"""GLM-5 (``glm_moe_dsa``: DeepSeek-V3.2's MLA, lightning indexer and MoE, the index keys rotated in interleaved pairs,
and "shared" layers that reuse the top-k of the last layer that ran its indexer) equals transformers'
``GlmMoeDsaForCausalLM`` on ``glm5-tiny``: greedy tokens one at a time, together, with the prefix cache hot, in
chunks off block boundaries under preemption, under tensor parallelism, and top-20 logprobs within 1e-4 in fp32. Its
prompts run past the indexer's top-k, so the sparse choice, its sharing and its rotation decide the tokens."""
from __future__ import annotations

import pytest
from transformers import GlmMoeDsaConfig

from engine import LLM, SamplingParams
from engine.config import IndexerConfig
from engine.models.deepseek_v32 import SparseMLAAttention
from tests.hf_oracle import (assert_greedy_alone_and_together, assert_greedy_cache_hot,
                             assert_greedy_through_preemption, assert_top_logprobs_equal_hf, assert_varied, hf_greedy,
                             random_prompts)

NAME = "glm5-tiny"
NEW_TOKENS = 8
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
VOCAB = 150_000  # ordinary text ids of the stand-in tokenizer
TOPK = 8  # glm5-tiny's index_topk: prompts past it attend sparsely


@pytest.fixture(scope="module")
def cases() -> tuple[LLM, list[list[int]], list[list[int]]]:
    llm = LLM(NAME, block_size=4, num_kv_blocks=512, max_num_batched_tokens=256)
    prompts = random_prompts(VOCAB, [3, 7, 16, 29, 45], seed=38)
    return llm, prompts, [hf_greedy(NAME, p, NEW_TOKENS) for p in prompts]


def test_layers_share_the_indexers_choice_as_configured(cases) -> None:
    llm, _, expected = cases
    assert_varied(expected, 3)
    layers = [m for m in llm.engine.runner.model.layers.modules() if isinstance(m, SparseMLAAttention)]
    assert [m.indexer is None for m in layers] == [False, True, False, True]
    assert len({id(m.choice) for m in layers}) == 1
    assert all(m.indexer is None or m.indexer.interleaved for m in layers)


def test_greedy_alone_together_and_cache_hot(cases) -> None:
    llm, prompts, expected = cases
    llm.reset_prefix_cache()
    assert_greedy_alone_and_together(llm, prompts, expected)
    assert_greedy_cache_hot(llm, prompts, expected, block_size=4)


@pytest.mark.slow  # the fast tier keeps the greedy equality
def test_top20_logprobs_within_1e_4(cases) -> None:
    llm, prompts, _ = cases
    llm.reset_prefix_cache()
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0, logprobs=20))
    for prompt, out in zip(prompts, outs):
        assert_top_logprobs_equal_hf(NAME, prompt, out.outputs[0].logprobs[0].top, atol=1e-4)


def _greedy_with(llm: LLM, prompts: list[list[int]], interleaved: bool, shared: bool) -> list[list[int]]:
    """Greedy tokens with the index keys rotated as GLM-5 (``interleaved``) or as V3.2, and with the shared layers
    reusing the choice before them (``shared``) or scoring with that layer's indexer themselves."""
    layers = [m for m in llm.engine.runner.model.layers.modules() if isinstance(m, SparseMLAAttention)]
    indexers = [m.indexer for m in layers]
    try:
        for i, m in enumerate(layers):
            if m.indexer is None and not shared:
                m.indexer = indexers[i - 1]
            if m.indexer is not None:
                m.indexer.interleaved = interleaved
        llm.reset_prefix_cache()
        return [o.token_ids for o in llm.generate(prompts, GREEDY)]
    finally:
        for m, indexer in zip(layers, indexers):
            m.indexer = indexer
            if indexer is not None:
                indexer.interleaved = True


@pytest.mark.slow  # ~5 s: the same prompts twice more
def test_the_sharing_and_the_rotation_decide_the_outputs(cases) -> None:
    """The same weights with V3.2's neox-style index keys, or with every layer running an indexer, continue the
    prompts longer than the top-k differently: the equality above checks GLM-5's two differences, not only V3.2's."""
    llm, prompts, expected = cases
    long = [i for i, p in enumerate(prompts) if len(p) > TOPK]
    want = [expected[i] for i in long]
    assert _greedy_with(llm, [prompts[i] for i in long], interleaved=True, shared=True) == want
    assert _greedy_with(llm, [prompts[i] for i in long], interleaved=False, shared=True) != want
    assert _greedy_with(llm, [prompts[i] for i in long], interleaved=True, shared=False) != want


@pytest.mark.slow  # ~8 s; the config sweep's glm_moe_dsa draws chunk and preempt too (slow tier)
def test_chunked_prefill_off_block_boundaries_with_preemption() -> None:
    """7 tokens a step (chunks end mid-block) in a pool of 20 blocks of 4: prefills beside decodes, some after a
    cached prefix, running requests preempted and recomputed."""
    base = random_prompts(VOCAB, [10], seed=21)[0]
    prompts = [base + tail for tail in random_prompts(VOCAB, [9, 19], seed=22)] + random_prompts(VOCAB, [26, 13],
                                                                                               seed=23)
    llm = LLM(NAME, block_size=4, num_kv_blocks=20, max_num_batched_tokens=7)
    llm.generate([base], SamplingParams(max_tokens=1))  # caches base's two full blocks
    assert_greedy_through_preemption(llm, prompts, [hf_greedy(NAME, p, 10) for p in prompts])


@pytest.mark.slow
def test_tensor_parallel_2_gives_one_ranks_tokens(cases) -> None:
    """Heads and experts split over two gloo ranks; the latent, the index keys and the indexers replicated."""
    _, prompts, expected = cases
    with LLM(NAME, block_size=4, num_kv_blocks=128, max_num_batched_tokens=16, tensor_parallel_size=2) as llm:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected


@pytest.mark.parametrize("config, shared", [
    ({"indexer_types": ["full", "shared", "shared", "full"]}, (False, True, True, False)),
    ({"index_topk_pattern": "FSFS"}, (False, True, False, True)),
    ({"index_topk_freq": 2, "index_skip_topk_offset": 2}, (False, False, True, False)),
    ({}, (False, False, False, False)),  # transformers' default schedule: every layer indexed
])
def test_the_shared_layers_are_read_as_transformers_derives_them(config: dict, shared: tuple) -> None:
    base = {"model_type": "glm_moe_dsa", "num_hidden_layers": 4, "index_n_heads": 4, "index_head_dim": 32,
            "index_topk": 8}
    indexer = IndexerConfig.from_dict({**base, **config})
    assert indexer.shared == shared and indexer.rope_interleaved
    assert [kind == "shared" for kind in GlmMoeDsaConfig(**{**base, **config}).indexer_types] == list(shared)
    with pytest.raises(ValueError, match="first layer"):
        IndexerConfig.from_dict({**base, "indexer_types": ["shared", "full", "full", "full"]})
