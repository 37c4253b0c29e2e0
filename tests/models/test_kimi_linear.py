"""Kimi Linear (KDA + MLA without RoPE + DeepSeek-V3's MoE) on a tiny checkpoint in the released layout
(tests/models/checkpoints/kimi_linear_model.py): greedy tokens equal transformers' KimiLinearForCausalLM one prompt
at a time and all together, with the cache hot (a state snapshot resumes the KDA layers), with chunked prefills that
end off block boundaries, under preemption, with the Triton kernels, on the next turn of a conversation (which reads
all but at most one block of the previous prompt and reply from the cache) and over two tensor-parallel ranks; top-20
logprobs within 1e-4 in fp32."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.hf_oracle import (
    assert_greedy_alone_and_together, assert_greedy_cache_hot, assert_greedy_through_preemption,
    assert_top_logprobs_equal_hf, assert_varied, hf_greedy, logit_shift, new_llm, random_prompts,
)
from tests.models.checkpoints.kimi_linear_model import VOCAB, write_kimi_linear_checkpoint

LENGTHS = [1, 4, 5, 17, 40, 70]  # 70 crosses a 64-token chunk of the delta rule
NEW_TOKENS = 8
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    path = str(write_kimi_linear_checkpoint(tmp_path_factory.mktemp("kimi_linear")))
    prompts = random_prompts(VOCAB, LENGTHS, seed=5)
    return path, prompts, [hf_greedy(path, p, NEW_TOKENS) for p in prompts]


def _llm(path: str, **options) -> LLM:
    return new_llm(path, **{"block_size": 4, "num_kv_blocks": 512, "num_state_snapshots": 64, **options})


def test_released_config_reads_as_transformers_does():
    """The released config.json's keys: 1-indexed layers in linear_attn_config, the MoE's names, no RoPE."""
    from engine.config import ModelConfig
    from tests.models.checkpoints.kimi_linear_model import released_config

    cfg = ModelConfig.from_dict(released_config())
    assert cfg.linear.layer_types == ("linear_attention", "full_attention") * 2 + ("linear_attention",)
    assert cfg.linear.channel_gate and (cfg.linear.num_value_heads, cfg.linear.key_head_dim) == (4, 16)
    assert cfg.mla is not None and not cfg.mla.rope and cfg.max_position_embeddings == 1048576
    moe = cfg.moe
    assert (moe.num_experts, moe.top_k, moe.num_shared_experts, moe.moe_layers) == (8, 2, 1, (1, 2, 3, 4))
    assert moe.scoring == "sigmoid" and moe.correction_bias and moe.norm_topk_prob
    assert moe.routed_scaling_factor == 2.446


@pytest.mark.slow
def test_greedy_one_at_a_time_and_all_together(case):
    path, prompts, expected = case
    assert_varied(expected, 6)
    llm = _llm(path)
    assert_greedy_alone_and_together(llm, prompts, expected)
    assert_greedy_cache_hot(llm, prompts, expected, block_size=4)


@pytest.mark.slow
def test_outputs_depend_on_the_whole_context(case):
    path, prompts, _ = case
    assert logit_shift(path, prompts[-1], 20) > 1.0, "a token 20 back moves the next one's logits"
    assert logit_shift(path, prompts[-1], 69) > 0.5, "so does the first token"


@pytest.mark.slow
def test_chunked_prefill_off_block_boundaries_and_preemption(case):
    """7 tokens a step with 4-token blocks: chunks end mid-block and continue their slot's KDA state; then a pool
    of 32 blocks that cannot hold every sequence: the newest are preempted and recomputed."""
    path, prompts, expected = case
    assert [o.token_ids for o in _llm(path, max_num_batched_tokens=7).generate(prompts, GREEDY)] == expected
    assert_greedy_through_preemption(_llm(path, num_kv_blocks=32, max_num_batched_tokens=32), prompts, expected)


@pytest.mark.slow
def test_next_turn_reads_all_but_one_block_of_prompt_and_reply(case):
    path, prompts, expected = case
    llm = _llm(path, max_num_batched_tokens=32)
    first = llm.generate(prompts, GREEDY)
    second = [p + o.token_ids + f for p, o, f in zip(prompts, first, random_prompts(VOCAB, [6] * len(prompts), 6))]
    outs = llm.generate(second, GREEDY)
    for prev, out in zip(prompts, outs):
        assert len(prev) + NEW_TOKENS - 4 <= out.num_cached_tokens <= len(prev) + NEW_TOKENS
    assert [o.token_ids for o in outs] == [hf_greedy(path, p, NEW_TOKENS) for p in second]
    llm.engine.scheduler.kv.check_invariants()


@pytest.mark.slow
def test_top20_logprobs_within_1e_4(case):
    path, prompts, _ = case
    outs = _llm(path, max_num_batched_tokens=32).generate(
        prompts, SamplingParams(max_tokens=1, temperature=0, logprobs=20))
    for prompt, out in zip(prompts, outs):
        assert_top_logprobs_equal_hf(path, prompt, out.outputs[0].logprobs[0].top, atol=1e-4)


@pytest.mark.slow
def test_triton_kernels_chunked_and_together(case):
    """The Triton op set under the interpreter (lean: it is slow): a 17-token prompt in chunks of 12 and 5 (KDA's
    chunked kernels, the second continuing the first's state), then decodes (its recurrent kernel), MLA and the
    MoE's kernels."""
    path, prompts, expected = case
    llm = _llm(path, attention_backend="triton", max_num_batched_tokens=12)
    out = llm.generate([prompts[3]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    assert out.token_ids == expected[3][:3]


@pytest.mark.slow
def test_tensor_parallel_2(case):
    """Two gloo ranks: each holds half the KDA heads (their conv channels, gates and state), half the MLA heads
    (the latent replicated) and half of every expert."""
    path, prompts, expected = case
    with _llm(path, num_kv_blocks=64, max_num_batched_tokens=16, tensor_parallel_size=2) as llm:
        outs = llm.generate(prompts[2:4], GREEDY)
    assert [o.token_ids for o in outs] == expected[2:4]


@pytest.mark.slow  # the registry model's build and transformers' own run of it
def test_the_registry_model_equals_transformers() -> None:
    """kimi-linear-tiny (models.yaml: this architecture with the released config keys and names, the Kimi stand-in
    tokenizer) gives transformers' greedy tokens, varied, alone, together and cache hot; its next turn reads all but
    at most one block of the previous prompt and reply (the KDA state's reply-end snapshot)."""
    llm = LLM("kimi-linear-tiny", block_size=4, num_kv_blocks=256)
    prompts = random_prompts(150_000, [3, 9, 17], seed=38)
    expected = [hf_greedy("kimi-linear-tiny", p, 6) for p in prompts]
    assert_varied(expected, 2)
    assert_greedy_alone_and_together(llm, prompts, expected)
    assert_greedy_cache_hot(llm, prompts, expected, block_size=4)
    # the next turn (prompt + reply + a new message) reads all of prompt and reply but at most one block
    outs = llm.generate([p + e + [11, 22, 33] for p, e in zip(prompts, expected)], GREEDY)
    assert all(len(p) + 6 - 4 <= o.num_cached_tokens for p, o in zip(prompts, outs))
    llm.close()
