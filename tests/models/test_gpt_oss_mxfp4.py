"""gpt-oss' experts kept in MXFP4 (engine/models/layers/mxfp4_experts.py) on the tiny checkpoint in gpt-oss-20b's
released layout (tests/models/checkpoints/gpt_oss_models.py: ``*_blocks`` / ``*_scales``, window 8, 8 experts of
intermediate 64, top-4): which backends keep them packed, what each rank reads, and greedy tokens equal to
transformers reading the same directory (it dequantizes MXFP4 itself) through the packed reference, the Triton kernel
under its interpreter, and two tensor-parallel ranks each holding whole 32-groups of every expert."""
from __future__ import annotations

import json

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig, MoEConfig
from engine.model_sources.mxfp4 import QUANTIZATION_CONFIG, released_expert_layout
from engine.models.gpt_oss import read_experts, read_packed_experts
from engine.models.layers.moe import Experts
from engine.models.layers.mxfp4_experts import Mxfp4Experts, keep_experts_packed
from engine.parallel.linear import ExpertSharding
from engine.parallel.state import TensorParallel
from kernels.ops import dequantize_mxfp4
from tests.hf_oracle import (CheckpointDirs, assert_greedy_alone_and_together, assert_greedy_cache_hot, hf_greedy,
                             random_prompts)
from tests.models.checkpoints.gpt_oss_models import VOCAB, write_gpt_oss_checkpoint

LENGTHS = [1, 4, 9, 17, 40, 70]  # all but the first two reach past the window
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def mxfp4_case(tmp_path_factory) -> tuple[str, list[list[int]], list[list[int]]]:
    path = CheckpointDirs(tmp_path_factory.mktemp("gpt_oss_mxfp4"), write_gpt_oss_checkpoint)["mxfp4"]
    prompts = random_prompts(VOCAB, LENGTHS, seed=3)
    return path, prompts, [hf_greedy(path, p, NEW_TOKENS) for p in prompts]


def test_auto_keeps_experts_packed_where_the_kernel_runs(tmp_path):
    """auto: packed on the Triton backend, dequantized on the CPU op sets; packed / dequantized as asked; a
    checkpoint without MXFP4 experts is never packed; an unknown choice is refused."""
    released, plain = tmp_path / "released", tmp_path / "plain"
    for directory, config in ((released, {"quantization_config": QUANTIZATION_CONFIG}), (plain, {})):
        directory.mkdir()
        (directory / "config.json").write_text(json.dumps({"model_type": "gpt_oss", **config}))
    assert [keep_experts_packed("auto", backend, released) for backend in ("triton", "cpu", "torch")] == [
        True, False, False]
    assert keep_experts_packed("packed", "cpu", released) and not keep_experts_packed("dequantized", "triton", released)
    assert not keep_experts_packed("packed", "triton", plain)
    with pytest.raises(ValueError, match="mxfp4_experts"):
        keep_experts_packed("fp4", "triton", released)
    with pytest.raises(ValueError, match="mxfp4_experts must be"):
        EngineConfig(mxfp4_experts="fp4")


def _released_experts(experts: int, hidden: int, inter: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = {"gate_up_proj": (experts, hidden, 2 * inter), "gate_up_proj_bias": (experts, 2 * inter),
              "down_proj": (experts, inter, hidden), "down_proj_bias": (experts, hidden)}
    stored = {name: torch.randn(*shape, generator=gen) for name, shape in shapes.items()}
    return released_expert_layout({f"x.mlp.experts.{name}": t for name, t in stored.items()})


def test_each_rank_reads_whole_groups_of_the_packed_experts():
    """The packed read unpacks to the dequantized read (gate rows then up rows); under tensor parallelism 2 the
    ranks' bytes and scales put back together are the one-rank ones (intermediate 64: a group of 32 a rank). With
    intermediate 96 a rank's 48 columns would cut a group: the packed experts refuse it when they are built."""
    tensors = {name.rsplit(".", 1)[1]: t for name, t in _released_experts(4, 64, 64).items()}

    def read(reader, name: str, tp: TensorParallel) -> torch.Tensor:
        return reader(name, lambda t, index: tensors[t][index], ExpertSharding(tp, 4, 64))

    one = TensorParallel()
    for weight in ("gate_up_proj", "down_proj"):
        blocks, scales = (read(read_packed_experts, f"{weight}_{part}", one) for part in ("blocks", "scales"))
        assert blocks.dtype == scales.dtype == torch.uint8 and blocks.shape[-1] == 16 * scales.shape[-1]
        assert torch.equal(dequantize_mxfp4(blocks, scales), read(read_experts, f"{weight}_blocks", one))
        for part in ("blocks", "scales"):
            whole = read(read_packed_experts, f"{weight}_{part}", one)
            ranks = [read(read_packed_experts, f"{weight}_{part}", TensorParallel(rank, 2)) for rank in (0, 1)]
            if weight == "gate_up_proj":  # each rank: its gate rows, then its up rows
                halves = [r.chunk(2, dim=1) for r in ranks]
                assert torch.equal(torch.cat([halves[0][0], halves[1][0], halves[0][1], halves[1][1]], 1), whole)
            else:
                assert torch.equal(torch.cat(ranks, dim=-1), whole)
    assert torch.equal(read(read_packed_experts, "down_proj_bias", one), tensors["down_proj_bias"])
    moe = MoEConfig(num_experts=4, top_k=2, intermediate_size=96, moe_layers=(0,), norm_topk_prob=False,
                    expert_bias=True)
    with torch.device("meta"):
        cut = Experts(64, moe, TensorParallel(0, 2))
    with pytest.raises(ValueError, match="whole groups of 32"):
        Mxfp4Experts(cut)


@pytest.mark.slow
def test_packed_reference_equals_transformers_alone_together_and_cache_hot(mxfp4_case):
    """The CPU's packed path (``mxfp4_experts="packed"``: the reference unpacks each routed expert per call), with
    the experts held as uint8 in about a quarter of the dequantized experts' bytes."""
    path, prompts, expected = mxfp4_case
    llm = LLM(path, mxfp4_experts="packed", block_size=4, num_kv_blocks=512)
    experts = llm.engine.runner.model.layers[0].mlp.experts
    assert isinstance(experts, Mxfp4Experts) and experts.down_proj_blocks.dtype == torch.uint8
    assert_greedy_alone_and_together(llm, prompts, expected)
    assert_greedy_cache_hot(llm, prompts, expected, 4)
    dequantized = LLM(path, block_size=4, num_kv_blocks=16).engine.runner.model.layers[0].mlp.experts
    packed_bytes = sum(p.numel() * p.element_size() for p in experts.parameters())
    dense_bytes = sum(p.numel() * p.element_size() for p in dequantized.parameters())
    assert packed_bytes < 0.3 * dense_bytes  # fp32 here; the biases stay in the model dtype


@pytest.mark.slow  # the whole model under the Triton interpreter (~25 s)
def test_triton_kernel_equals_transformers(mxfp4_case):
    """On the Triton backend (auto keeps the experts packed) the MXFP4 kernel runs every MoE layer: one 17-token
    prompt, past the window, 4 tokens."""
    path, prompts, expected = mxfp4_case
    llm = LLM(path, attention_backend="triton", block_size=4, num_kv_blocks=64)
    assert isinstance(llm.engine.runner.model.layers[0].mlp.experts, Mxfp4Experts)
    out = llm.generate([prompts[3]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert out[0].token_ids == expected[3][:4]


@pytest.mark.slow
def test_tensor_parallel_2_with_packed_experts_equals_transformers(mxfp4_case):
    """Two ranks, each with one group of 32 of every expert's intermediate columns, packed."""
    path, prompts, expected = mxfp4_case
    chosen = [1, 3, 5]
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    with LLM(path, tensor_parallel_size=2, mxfp4_experts="packed", block_size=4, num_kv_blocks=128,
             max_num_batched_tokens=32) as llm:
        outs = llm.generate([prompts[i] for i in chosen], greedy)
    assert [o.token_ids for o in outs] == [expected[i] for i in chosen]


def test_packed_experts_are_a_third_of_gpt_oss_20b_in_bf16():
    """The engine's weights for gpt-oss-20b's config (built on the meta device): 38.96 GiB with the experts
    dequantized to bf16, 12.82 GiB with them kept in MXFP4 (the release's 12.8 GiB)."""
    from benchmarks.gpu.models import GPT_OSS_20B, engine_weight_bytes

    dequantized, packed = engine_weight_bytes(GPT_OSS_20B), engine_weight_bytes(GPT_OSS_20B, packed_experts=True)
    assert round(dequantized / 2**30, 2) == 38.96 and round(packed / 2**30, 2) == 12.82
