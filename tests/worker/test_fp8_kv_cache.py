"""``kv_cache_dtype="fp8"``: KV pages stored as e4m3 (scale 1.0) run on CPU within a stated logprob distance of
the model-dtype cache, hold twice the tokens of bf16 pages in the same memory, and keep the prefix cache exact.

Stated distances (tests/models/checkpoints/logprob_drift.py: teacher-forced, 10 prompts x 10 tokens, top-20 logprobs, fp32
model, FP8 pages against fp32 pages), measured:

    model           mean |dlogprob|  max |dlogprob|  same argmax   (the same model in bf16: mean, max, argmax)
    qwen3-tiny      0.066            0.62            77%           (0.017, 0.11, 92%)
    deepseek-tiny   0.36             3.56            64%           (0.11, 0.94, 91%)

The bounds below leave about 1.5x of room. The tiny models' attention is deliberately sharp (so that context
matters), which makes them more sensitive to K rounding than real models.
"""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.hf_oracle import random_prompts
from tests.models.checkpoints.logprob_drift import logprob_drift

LENGTHS = [1, 3, 4, 5, 8, 15, 16, 17, 33, 64]
STATED = {"qwen3-tiny": (0.1, 1.0, 0.65), "deepseek-tiny": (0.55, 5.0, 0.5)}  # mean, max, argmax agreement


@pytest.mark.parametrize("name", sorted(STATED))
@pytest.mark.slow
def test_fp8_kv_cache_stays_within_the_stated_logprob_distance(name: str):
    original = LLM(name, block_size=4, num_kv_blocks=1024)
    fp8 = LLM(name, block_size=4, num_kv_blocks=1024, kv_cache_dtype="fp8")
    assert all(k.dtype == v.dtype == torch.float8_e4m3fn for k, v in fp8.engine.runner.kv_caches)
    prompts = random_prompts(original.engine.model_cfg.vocab_size, LENGTHS, seed=1)
    drift = logprob_drift(original, fp8, prompts, 10)
    mean, most, agreement = STATED[name]
    assert drift.mean_abs <= mean and drift.max_abs <= most and drift.argmax_agreement >= agreement, drift
    assert drift.max_abs > 0


@pytest.mark.slow
def test_fp8_pages_hold_twice_the_tokens_of_bf16_pages_in_the_same_memory():
    blocks = {}
    for dtype, kv in (("bfloat16", "auto"), ("bfloat16", "fp8"), ("float32", "auto")):
        llm = LLM("qwen3-tiny", block_size=16, kv_cache_memory_gb=0.01, dtype=dtype, kv_cache_dtype=kv)
        blocks[dtype, kv] = llm.engine.runner.num_blocks
        page = llm.engine.runner.kv_caches[0][0]
        assert page.element_size() == {"fp8": 1, "auto": torch.finfo(getattr(torch, dtype)).bits // 8}[kv]
    # 2 layers x (K + V) x 16 tokens x 2 KV heads x 16 dims: 2 KiB per block in FP8, 0.01 GiB = 5242 blocks
    assert blocks["bfloat16", "fp8"] == 5242
    assert blocks["bfloat16", "fp8"] // 2 == blocks["bfloat16", "auto"]
    assert blocks["bfloat16", "fp8"] // 4 == blocks["float32", "auto"]


@pytest.mark.slow
def test_fp8_kv_prefix_cache_hits_reproduce_cold_outputs():
    llm = LLM("qwen3-tiny", block_size=4, num_kv_blocks=256, kv_cache_dtype="fp8")
    prompts = random_prompts(50_000, [9, 22], seed=4)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=5)
    cold = llm.generate(prompts, params)
    hot = llm.generate(prompts, params)
    assert [o.num_cached_tokens for o in hot] == [8, 20]
    assert [o.token_ids for o in hot] == [o.token_ids for o in cold]
    for h, c in zip(hot, cold):  # the same pages; only the fp32 summation order of the prefill differs
        got = torch.tensor([[lp for _, lp in step.top] for step in h.outputs[0].logprobs])
        want = torch.tensor([[lp for _, lp in step.top] for step in c.outputs[0].logprobs])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_fp8_kv_cache_triton_backend_gives_the_torch_backends_tokens():
    """The Triton store and attention kernels (the interpreter here) write the same e4m3 bytes and read them back
    as the torch reference does."""
    prompts = random_prompts(50_000, [5, 13], seed=6)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    tokens = [
        [o.token_ids for o in LLM("qwen3-tiny", block_size=4, num_kv_blocks=64, kv_cache_dtype="fp8",
                                  attention_backend=backend).generate(prompts, params)]
        for backend in ("torch", "triton")
    ]
    assert tokens[0] == tokens[1]


def test_engine_flag_sets_the_kv_cache_dtype(capsys):
    import argparse

    from server.cli.engine_args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args(["--device", "cpu"])).kv_cache_torch_dtype == torch.float32
    cfg = engine_config_from_args(parser.parse_args(["--device", "cpu", "--kv-cache-dtype", "fp8"]))
    assert cfg.kv_cache_torch_dtype == torch.float8_e4m3fn
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["--kv-cache-dtype", "int4"])
    assert exit_info.value.code == 2 and "--kv-cache-dtype: invalid choice: 'int4'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="kv_cache_dtype must be 'auto' or 'fp8'"):
        LLM("qwen3-tiny", kv_cache_dtype="int8")
