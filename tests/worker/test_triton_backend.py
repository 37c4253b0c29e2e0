"""End to end: the Triton kernels (under the interpreter on CPU) give the torch backend's greedy tokens, for the dense
decoder, Qwen3-MoE (fused MoE), the DeepSeek-V3 architecture (fused MoE, MLA decode) and DeepSeek-V3.2 (the
indexer's scores and the sparse MLA)."""
from __future__ import annotations

import pytest

from engine import SamplingParams
from tests.hf_oracle import new_llm, random_prompts


@pytest.mark.parametrize("name", ["qwen3-tiny", "qwen3-moe-tiny", "deepseek-v3-tiny",
                                  pytest.param("deepseek-v3.2-tiny", marks=pytest.mark.slow)])
@pytest.mark.fast_cases("qwen3-tiny")
def test_triton_backend_matches_torch_on_mixed_batch_with_cache_hits(name: str) -> None:
    base = random_prompts(50_000, [13], seed=41)[0]
    tails = random_prompts(50_000, [2, 6, 1], seed=42)
    prompts = [base + t for t in tails] + random_prompts(50_000, [5, 11], seed=43)
    # A long decode (first request) runs while later prompts prefill in chunks: each step mixes both.
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (6, 3, 4, 2, 5)]
    results = {}
    for backend in ("torch", "triton"):
        llm = new_llm(name, block_size=4, num_kv_blocks=128, max_num_batched_tokens=12, attention_backend=backend)
        llm.generate([base], SamplingParams(max_tokens=1))  # caches base's 3 full blocks
        outs = llm.generate(prompts, params)
        assert [o.num_cached_tokens for o in outs[:3]] == [12, 12, 12]
        results[backend] = [o.token_ids for o in outs]
    assert results["triton"] == results["torch"]
