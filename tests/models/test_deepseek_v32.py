"""DeepSeek-V3.2 (MLA + the lightning indexer's top-k sparse attention) beyond the shared HF-equality suite: the
sparse selection really decides the outputs, steps mixing chunked prefills with decodes under preemption, top-20
logprobs within 1e-4, the index keys' pages beside the latent, and a directory written by transformers'
``save_pretrained``."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.models.layers.indexer import Indexer
from engine.registry import resolve_model
from tests.hf_oracle import assert_top_logprobs_equal_hf, hf_greedy, hf_model, random_prompts
from tests.models.test_moe_mla_models import _save_pretrained_copy

NAME = "deepseek-v3.2-tiny"
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
TOPK = 16  # the tiny model's index_topk: prompts longer than this attend sparsely


def test_index_keys_have_pages_beside_the_latent() -> None:
    llm = LLM(NAME, block_size=4, num_kv_blocks=8)
    runner = llm.engine.runner
    assert [tuple(t.shape) for t in runner.kv_caches[0]] == [(8, 4, 1, 32 + 16), (8, 4, 1, 32)]
    assert runner.kv_spec.bytes_per_token(torch.float32) == 3 * (48 + 32) * 4


@pytest.mark.slow
def test_sparse_selection_decides_the_outputs() -> None:
    """The same weights attending to every token (a top-k past any context) continue long prompts differently:
    equality with transformers below therefore checks the indexer's choices, not only dense MLA."""
    prompts = random_prompts(50_000, [40, 55, 70], seed=3)
    llm = LLM(NAME, block_size=4, num_kv_blocks=128)
    sparse = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert sparse == [hf_greedy(NAME, p, GREEDY.max_tokens) for p in prompts]
    for module in llm.engine.runner.model.modules():
        if isinstance(module, Indexer):
            assert module.topk == TOPK
            module.topk = 4096
    llm.reset_prefix_cache()
    dense = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert all(s != d for s, d in zip(sparse, dense))


@pytest.mark.slow
def test_chunked_prefill_and_preemption_match_hf() -> None:
    """A pool of 24 blocks of 4 tokens and 8 tokens a step: prompts prefill in chunks beside running decodes, some
    after a cached prefix, and running requests are preempted and recomputed."""
    base = random_prompts(50_000, [12], seed=21)[0]
    prompts = [base + tail for tail in random_prompts(50_000, [9, 23], seed=22)] + random_prompts(50_000, [30, 17],
                                                                                                   seed=23)
    llm = LLM(NAME, block_size=4, num_kv_blocks=24, max_num_batched_tokens=8)
    llm.generate([base], SamplingParams(max_tokens=1))  # caches base's three full blocks
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert outs[0].num_cached_tokens == 12
    assert llm.stats.preemptions > 0
    assert [o.token_ids for o in outs] == [hf_greedy(NAME, p, params.max_tokens) for p in prompts]


@pytest.mark.slow
@pytest.mark.slow
def test_top20_logprobs_within_1e_4() -> None:
    prompts = random_prompts(50_000, [5, 33, 60], seed=7)
    llm = LLM(NAME, block_size=4, num_kv_blocks=128, max_num_batched_tokens=16)  # chunked prefills
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0, logprobs=20))
    for prompt, out in zip(prompts, outs):
        assert_top_logprobs_equal_hf(NAME, prompt, out.outputs[0].logprobs[0].top, atol=1e-4)


@pytest.mark.slow
@pytest.mark.slow
def test_directory_written_by_transformers_save_pretrained(tmp_path: Path) -> None:
    model_dir = _save_pretrained_copy(hf_model(NAME), resolve_model(NAME), tmp_path / NAME)
    prompts = random_prompts(50_000, [5, 26], seed=31)
    llm = LLM(str(model_dir), block_size=4, num_kv_blocks=128)
    assert llm.engine.model_cfg.indexer.topk == TOPK
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [hf_greedy(NAME, p, GREEDY.max_tokens) for p in prompts]
