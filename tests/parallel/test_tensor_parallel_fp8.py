"""FP8 block-scaled checkpoints under tensor parallelism: each rank reads its slices of the e4m3 weights and of their
scale grids. Dequantized on load (CPU), a rank's slice may start inside a block; kept in FP8 (the Triton GEMM, here
interpreted) slices must be whole blocks, and a size that cuts blocks fails at start-up with the worker's reason."""
from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.errors import WorkerDiedError
from engine.registry import resolve_model
from tests.hf_oracle import new_llm, random_prompts
from tests.models.checkpoints.fp8_checkpoint import write_fp8_checkpoint


def _fp8_dir(tmp_path_factory, block: tuple[int, int]):
    path = tmp_path_factory.mktemp("fp8") / f"qwen3-tiny-fp8-{block[0]}"
    write_fp8_checkpoint(resolve_model("qwen3-tiny"), path, block)
    return path


def _generate(model_dir, **options) -> tuple[list, list[float]]:
    prompts = random_prompts(50_000, [3, 17, 30], seed=2)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=1)
    with new_llm(str(model_dir), block_size=4, num_kv_blocks=64, **options) as llm:
        outs = llm.generate(prompts, params)
    return [o.token_ids for o in outs], [lp.logprob for o in outs for lp in o.outputs[0].logprobs]


@pytest.mark.slow
def test_dequantized_on_load_with_slices_inside_blocks(tmp_path_factory):
    """32 x 32 blocks: rank 1's half of the 2 x 16-row KV heads starts 16 rows into a block."""
    fp8_dir = _fp8_dir(tmp_path_factory, (32, 32))
    tokens, logprobs = _generate(fp8_dir)
    parallel_tokens, parallel_logprobs = _generate(fp8_dir, tensor_parallel_size=2)
    assert parallel_tokens == tokens
    assert max(abs(a - b) for a, b in zip(parallel_logprobs, logprobs)) < 1e-4


@pytest.mark.slow
def test_kept_in_fp8_with_whole_blocks_per_rank(tmp_path_factory):
    fp8_dir = _fp8_dir(tmp_path_factory, (16, 16))
    tokens, logprobs = _generate(fp8_dir, attention_backend="triton")
    parallel_tokens, parallel_logprobs = _generate(fp8_dir, attention_backend="triton", tensor_parallel_size=2)
    assert parallel_tokens == tokens
    assert max(abs(a - b) for a, b in zip(parallel_logprobs, logprobs)) < 1e-4


def test_kept_in_fp8_refuses_slices_that_cut_blocks(tmp_path_factory):
    fp8_dir = _fp8_dir(tmp_path_factory, (32, 32))
    with pytest.raises(WorkerDiedError, match=r"rank 1 .* exited with status 1:(.|\n)*k_proj.weight: this rank's "
                                              r"part starts inside a \[32, 32\] FP8 block"):
        new_llm(str(fp8_dir), num_kv_blocks=64, attention_backend="triton", tensor_parallel_size=2)
