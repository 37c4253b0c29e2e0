"""Hybrid models (Gated DeltaNet + gated attention: Qwen3.5 / 3.6 dense with its vision tower, Qwen3.5-MoE,
Qwen3-Next) on directories written by transformers' save_pretrained: greedy tokens equal transformers one prompt at a
time, all together, with chunked prefills that end off block boundaries and under preemption; top-20 logprobs
within 1e-4 in fp32; the vision tower is skipped and the MTP weights are left loadable."""
from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import SamplingParams
from tests.hf_oracle import (
    assert_greedy_alone_and_together, assert_greedy_through_preemption, assert_top_logprobs_equal_hf, assert_varied,
    hf_greedy, logit_shift, new_llm, random_prompts,
)
from tests.models.checkpoints.hybrid_models import KINDS

LENGTHS = [1, 4, 5, 17, 40, 70]  # 70 crosses a 64-token chunk of the delta rule
NEW_TOKENS = 8
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


# Qwen3.5 dense runs in the fast tier; the MoE and Qwen3-Next variants of every sweep are marked slow
SWEEP = [pytest.param(kind, marks=() if kind == "qwen3_5" else pytest.mark.slow) for kind in KINDS]


@pytest.fixture(scope="module", params=SWEEP)
def case(request, hybrid_dirs):
    path = hybrid_dirs[request.param]
    prompts = random_prompts(151_000, LENGTHS, seed=len(request.param))
    return path, prompts, [hf_greedy(path, p, NEW_TOKENS) for p in prompts]


@pytest.mark.slow
def test_outputs_are_varied_and_depend_on_the_whole_context(case):
    path, prompts, expected = case
    assert_varied(expected, 6)
    assert logit_shift(path, prompts[-1], 20) > 2.0, "a token 20 back moves the next one's logits"
    assert logit_shift(path, prompts[-1], 69) > 0.5, "so does the first token"


@pytest.mark.slow
def test_greedy_one_at_a_time_and_all_together(case):
    path, prompts, expected = case
    llm = new_llm(path, block_size=4, num_kv_blocks=512)
    assert_greedy_alone_and_together(llm, prompts, expected)
    llm.engine.scheduler.kv.check_invariants()


@pytest.mark.slow
def test_chunked_prefill_ending_off_block_boundaries(case):
    """A 7-token budget with 4-token blocks: chunks end mid-block, decodes and prefill chunks share steps, and each
    chunk's delta rule and conv continue the state the previous chunk left in the sequence's slot."""
    path, prompts, expected = case
    llm = new_llm(path, block_size=4, num_kv_blocks=512, max_num_batched_tokens=7)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected


@pytest.mark.slow
@pytest.mark.parametrize("case", ["qwen3_5"], indirect=True)  # the kernels are the same for every architecture
def test_triton_kernels_chunked_and_together(case):
    """The Triton op set (the recurrent kernels of kernels/triton/recurrent.py among them, under the interpreter on
    CPU, so on three prompts: 5, 17 and 40 tokens): chunked prefills sharing steps with decodes, each chunk
    continuing its slot's state, give transformers' tokens. (Chunks of more than 64 tokens:
    tests/kernels/test_recurrent.py.)"""
    path, prompts, expected = case
    llm = new_llm(path, attention_backend="triton", block_size=4, num_kv_blocks=512, max_num_batched_tokens=24)
    assert [o.token_ids for o in llm.generate(prompts[2:5], GREEDY)] == expected[2:5]


@pytest.mark.fast_cases("qwen3_5")
def test_preemption_in_a_small_pool(case):
    """32 blocks of 4 tokens cannot hold every sequence: the newest are preempted, recomputed from scratch (their
    state row freed and a fresh one taken), and still give transformers' tokens."""
    path, prompts, expected = case
    llm = new_llm(path, block_size=4, num_kv_blocks=32, max_num_batched_tokens=32)
    assert_greedy_through_preemption(llm, prompts, expected)


@pytest.mark.slow
def test_top20_logprobs_within_1e_4(case):
    path, prompts, _ = case
    llm = new_llm(path, block_size=4, num_kv_blocks=512, max_num_batched_tokens=32)
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0, logprobs=20))
    for prompt, out in zip(prompts, outs):
        assert_top_logprobs_equal_hf(path, prompt, out.outputs[0].logprobs[0].top, atol=1e-4)


@pytest.mark.slow
def test_vision_tower_skipped_and_mtp_weights_left_loadable(hybrid_dirs, tmp_path: Path, caplog):
    """The released Qwen3.5 / 3.6 checkpoints carry a vision tower (skipped, one log line) and an MTP head
    (``mtp.*``: left on disk, one log line, unless the engine drafts with it: --speculative mtp)."""
    model_dir = tmp_path / "with_mtp"
    shutil.copytree(hybrid_dirs["qwen3_5"], model_dir)
    tensors = load_file(model_dir / "model.safetensors")
    assert any(name.startswith("model.visual.") for name in tensors)
    tensors["mtp.fc.weight"] = torch.ones(64, 128)
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    with caplog.at_level(logging.INFO, logger="engine.weights"):
        llm = new_llm(str(model_dir), block_size=4, num_kv_blocks=64)
    assert sum("vision tower" in r.message for r in caplog.records) == 1
    assert llm.engine.model_cfg.has_vision_tower and llm.engine.model_cfg.is_hybrid
    assert not any("mtp" in name or "visual" in name for name, _ in llm.engine.runner.model.named_parameters())
    assert sum("left 1 multi-token-prediction tensors" in r.message for r in caplog.records) == 1


@pytest.mark.slow
def test_state_rows_follow_the_model(hybrid_dirs):
    """Pages only for the full-attention layer; per linear-attention layer a conv window (model dtype) and an fp32
    delta-rule state per slot, one slot per sequence the engine may run and one per draft a step may verify (the
    states after each verified position, docs/SPECULATIVE.md)."""
    llm = new_llm(hybrid_dirs["qwen3_5"], block_size=4, num_kv_blocks=16, max_num_seqs=6, dtype="bfloat16",
              speculative_draft_budget=5)
    runner = llm.engine.runner
    shapes = [[(tuple(t.shape), t.dtype) for t in layer] for layer in runner.kv_caches]
    state = [((6 + 5, 2 * 2 * 16 + 4 * 16, 3), torch.bfloat16), ((6 + 5, 4, 16, 16), torch.float32)]
    assert shapes == [state, state, state, [((16, 4, 2, 32), torch.bfloat16)] * 2]
    assert runner.kv_spec.bytes_per_token(torch.bfloat16) == 2 * 2 * 32 * 2  # one attention layer
    assert runner.kv_spec.recurrent.bytes_per_state(torch.bfloat16) == 3 * (128 * 3 * 2 + 4 * 16 * 16 * 4)


@pytest.mark.parametrize("name", ["qwen3.6-tiny", pytest.param("qwen3.6-moe-tiny", marks=pytest.mark.slow)])
@pytest.mark.slow
def test_registry_tiny_models_match_transformers(name):
    """The registry's qwen3.6-tiny / qwen3.6-moe-tiny (language-model-only layout, the real Qwen3.6 vocabulary),
    in steps that mix chunked prefills with decodes."""
    prompts = random_prompts(248_000, [3, 17, 45], seed=1)
    llm = new_llm(name, block_size=4, num_kv_blocks=256, max_num_batched_tokens=16)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [hf_greedy(name, p, NEW_TOKENS) for p in prompts]


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.slow
def test_tensor_parallel_2_matches_one_rank(kind, hybrid_dirs):
    """Two gloo ranks on CPU: each holds half the key/value heads of every linear-attention layer (and their
    conv channels and state), half the attention heads and MLPs; the tokens are those of one rank, and HF's."""
    path = hybrid_dirs[kind]
    prompts = random_prompts(151_000, [5, 17, 40], seed=3)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)
    with new_llm(path, block_size=4, num_kv_blocks=64, max_num_batched_tokens=16, tensor_parallel_size=2) as llm:
        outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [hf_greedy(path, p, 6) for p in prompts]
