"""Prompt logprobs (`SamplingParams.prompt_logprobs`): equal to HF transformers' on the same weights, whether the
prompt is prefilled in one step or in chunks, was already in the prefix cache, or was preempted and recomputed."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.outputs import TokenLogprobs
from tests.hf_oracle import hf_model, random_prompts

SCORE = SamplingParams(max_tokens=0, prompt_logprobs=3)


def hf_prompt_logprobs(name: str, prompt: list[int]) -> torch.Tensor:
    """log p(token i | tokens < i) for i >= 1, and the full distributions, from transformers."""
    with torch.no_grad():
        logits = hf_model(name)(torch.tensor([prompt])).logits[0, :-1].float()
    return logits.log_softmax(dim=-1)


def assert_matches_hf(name: str, prompt: list[int], entries: list[TokenLogprobs | None], num_top: int = 3) -> None:
    assert len(entries) == len(prompt) and entries[0] is None
    expected = hf_prompt_logprobs(name, prompt)
    for i, entry in enumerate(entries[1:]):
        row, chosen = expected[i], expected[i, prompt[i + 1]]
        assert entry.token_id == prompt[i + 1] and abs(entry.logprob - chosen.item()) < 1e-4
        # A random model's 150k logprobs hold near-ties: rank and order are compared up to the tolerance.
        assert int((row > chosen + 1e-4).sum()) < entry.rank <= int((row > chosen - 1e-4).sum()) + 1
        top = row.topk(num_top)
        assert all(abs(value - row[t].item()) < 1e-4 for t, value in entry.top)
        assert torch.allclose(torch.tensor([v for _, v in entry.top]), top.values, atol=1e-4)


def _check_scores(llm: LLM) -> None:
    prompts = random_prompts(50_000, [2, 9, 37], seed=41)
    llm.reset_prefix_cache()
    for prompt, out in zip(prompts, llm.generate(prompts, SCORE)):
        assert out.token_ids == [] and out.finish_reason == "length"
        assert_matches_hf("qwen3-tiny", prompt, out.outputs[0].prompt_logprobs)


@pytest.mark.slow
def test_prompt_logprobs_equal_transformers_in_chunks():
    _check_scores(LLM("qwen3-tiny", block_size=4, num_kv_blocks=512, max_num_batched_tokens=8))


@pytest.mark.slow
@pytest.mark.slow
def test_prompt_logprobs_equal_transformers_in_one_step_and_overlapped(qwen3_llm: LLM):
    _check_scores(qwen3_llm)
    _check_scores(LLM("qwen3-tiny", block_size=4, num_kv_blocks=512, max_num_batched_tokens=8, async_scheduling=True))


def test_a_cached_prompt_is_recomputed_not_dropped(qwen3_llm: LLM):
    (prompt,) = random_prompts(50_000, [30], seed=42)
    qwen3_llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0))  # the prompt is cached now
    assert qwen3_llm.generate([prompt], SamplingParams(max_tokens=1))[0].num_cached_tokens == 28
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=3, n=2)
    out = qwen3_llm.generate([prompt], params)[0]
    assert out.num_cached_tokens == 0  # scored positions are computed, never read from the cache
    assert_matches_hf("qwen3-tiny", prompt, out.outputs[0].prompt_logprobs)
    assert out.outputs[1].prompt_logprobs is None and len(out.outputs[1].token_ids) == 4  # the leader scores
    # Generation after scoring is unchanged.
    plain = qwen3_llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == plain.token_ids


@pytest.mark.slow
@pytest.mark.slow
def test_preempted_scoring_recomputes_and_merges():
    """A pool too small for both sequences: the second is preempted mid-prefill (while the first decodes), comes back
    with part of its prompt cached, recomputes from its first unscored position, and scores some tokens twice; its
    prompt logprobs are still those of one clean pass."""
    prompts = random_prompts(50_000, [41, 39], seed=43)
    llm = LLM("qwen3-tiny", block_size=4, num_kv_blocks=20, max_num_batched_tokens=8)
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, prompt_logprobs=1))
    assert llm.stats.preemptions > 0 and llm.stats.prefix_cache_preempted_hits_tokens > 0
    for prompt, out in zip(prompts, outs):
        assert_matches_hf("qwen3-tiny", prompt, out.outputs[0].prompt_logprobs, num_top=1)


def test_bad_prompt_logprobs_are_rejected():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="grammar"):
        from engine.sampling_params import StructuredOutputSpec

        SamplingParams(max_tokens=0, structured_output=StructuredOutputSpec("regex", "a"))


def _score_beside_a_bystander(llm: LLM, prompt: list[int]) -> tuple[list[TokenLogprobs | None], list[int]]:
    """The prompt's logprobs, scored while a short request decodes beside it; and that request's tokens."""
    score, plain = llm.generate([prompt, prompt[:5]], [SamplingParams(max_tokens=1, prompt_logprobs=3),
                                                       SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)])
    return score.outputs[0].prompt_logprobs, plain.token_ids


@pytest.mark.parametrize("model", ["qwen3-tiny", pytest.param("qwen3.6-tiny", marks=pytest.mark.slow)])
def test_scoring_spread_over_steps_gives_the_unspread_values(model: str, qwen3_llm: LLM):
    """--max-scored-tokens-per-step spreads a prompt's scoring over steps (a decoding bystander between them); each
    position's logprob and alternatives are those of the prompt scored in one step (float noise apart: a random
    model's 150k logprobs hold near-ties, so ranks are checked against transformers' up to the tolerance)."""
    (prompt,) = random_prompts(50_000, [60], seed=44)
    whole_llm = qwen3_llm if model == "qwen3-tiny" else LLM(model, block_size=4, num_kv_blocks=512)
    assert whole_llm.engine.cfg.max_scored_tokens_per_step >= len(prompt)  # the default (64): in one step
    whole, whole_bystander = _score_beside_a_bystander(whole_llm, prompt)
    llm = LLM(model, block_size=4, num_kv_blocks=512, max_scored_tokens_per_step=8)
    spread, spread_bystander = _score_beside_a_bystander(llm, prompt)
    llm.close()
    assert spread_bystander == whole_bystander and spread[0] is whole[0] is None
    for a, b in zip(whole[1:], spread[1:], strict=True):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
        assert all(abs(x - y) < 1e-4 for (_, x), (_, y) in zip(a.top, b.top))
    assert_matches_hf(model, prompt, spread)
