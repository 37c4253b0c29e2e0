"""MiniMax-M2 (``minimax_m2``: q/k RMS-normalized across all heads, partial RoPE, sigmoid-routed MoE with a correction
bias in every layer) on a tiny checkpoint in the released layout (``block_sparse_moe.experts.N.w1``, the router's bias
beside its gate): top-20 logprobs within 1e-4 of transformers' ``MiniMaxM2ForCausalLM`` in fp32, greedy tokens equal
to it, and tensor parallelism 2 giving one rank's tokens (each rank normalizes its heads with the sum of squares of
all). The config sweep (tests/config) covers the cache scenarios over drawn configurations."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from engine import LLM, SamplingParams
from tests.config.config_sweep import Drawn, write_checkpoint
from tests.hf_oracle import (
    assert_greedy_alone_and_together,
    assert_greedy_cache_hot,
    assert_varied,
    hf_greedy,
    random_prompts,
)

CONFIG = dict(vocab_size=2048, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, rotary_dim=8, num_local_experts=8, num_experts_per_tok=2,
              max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=5_000_000.0, tie_word_embeddings=False)
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(Drawn("minimax_m2", CONFIG, 4, ()), tmp_path_factory.mktemp("minimax_m2"), seed=7)


@pytest.fixture(scope="module")
def reference(checkpoint: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()


def _hf_greedy(model, prompt: list[int], new: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long), pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_the_checkpoint_is_in_the_released_layout(checkpoint: Path) -> None:
    with safe_open(str(checkpoint / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    moe = "model.layers.0.block_sparse_moe"
    assert {f"{moe}.experts.7.w3.weight", f"{moe}.gate.weight", f"{moe}.e_score_correction_bias",
            "model.layers.0.self_attn.q_norm.weight"} <= names
    with safe_open(str(checkpoint / "model.safetensors"), framework="pt") as f:
        assert tuple(f.get_tensor("model.layers.0.self_attn.k_norm.weight").shape) == (2 * 16,)  # across heads
    assert json.loads((checkpoint / "config.json").read_text())["rotary_dim"] == 8


def test_greedy_and_top20_logprobs_equal_transformers(checkpoint: Path, reference) -> None:
    prompts = random_prompts(2000, [1, 6, 17, 30], seed=9)
    llm = LLM(str(checkpoint), block_size=4, num_kv_blocks=128, max_num_batched_tokens=7)
    outs = llm.generate(prompts, GREEDY)
    expected = [_hf_greedy(reference, p, GREEDY.max_tokens) for p in prompts]
    assert [o.token_ids for o in outs] == expected
    assert len({tuple(e) for e in expected}) == len(expected)
    llm.reset_prefix_cache()
    for prompt, out in zip(prompts, llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0, logprobs=20))):
        with torch.no_grad():
            ref = torch.log_softmax(reference(torch.tensor([prompt])).logits[0, -1].float(), -1)
        top = out.outputs[0].logprobs[0].top
        ids = torch.tensor([t for t, _ in top])
        torch.testing.assert_close(torch.tensor([lp for _, lp in top]), ref[ids], atol=1e-4, rtol=0)
        assert ids[0].item() == int(ref.argmax())


@pytest.mark.slow
def test_tensor_parallel_2_gives_one_ranks_tokens(checkpoint: Path) -> None:
    prompts = random_prompts(2000, [3, 14, 25], seed=11)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
    engine = dict(block_size=4, num_kv_blocks=64, max_num_batched_tokens=16)
    with LLM(str(checkpoint), **engine) as one, LLM(str(checkpoint), tensor_parallel_size=2, **engine) as two:
        single, parallel = one.generate(prompts, params), two.generate(prompts, params)
    assert [o.token_ids for o in parallel] == [o.token_ids for o in single]
    for a, b in zip(single, parallel):
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert abs(x.logprob - y.logprob) < 1e-4


@pytest.mark.slow  # the registry model's build and transformers' own run of it
def test_the_registry_model_equals_transformers() -> None:
    """minimax-m2-tiny (models.yaml: this architecture with MiniMax-M2's config keys and the stand-in tokenizer) gives
    transformers' greedy tokens, varied, alone, together and cache hot."""
    llm = LLM("minimax-m2-tiny", block_size=4, num_kv_blocks=256)
    prompts = random_prompts(150_000, [3, 9, 17], seed=38)
    expected = [hf_greedy("minimax-m2-tiny", p, 6) for p in prompts]
    assert_varied(expected, 2)
    assert_greedy_alone_and_together(llm, prompts, expected)
    assert_greedy_cache_hot(llm, prompts, expected, block_size=4)
    llm.close()
