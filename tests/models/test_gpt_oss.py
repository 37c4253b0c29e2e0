"""gpt-oss on tiny random checkpoints written by transformers' own save_pretrained (tests/models/checkpoints/gpt_oss_models.py), in
both released layouts: the experts stacked as transformers holds them (bf16 layout, here fp32) and as gpt-oss-20b
ships them (MXFP4 ``*_blocks`` / ``*_scales``, dequantized on load). Window layers (8 tokens) alternate with full ones,
so every prompt but the shortest reaches past the window; attention sinks, biases on every projection, top-4 routing
and the clamped SwiGLU all take part.

Greedy tokens equal transformers' one prompt at a time, all together, with the prefix cache hot, with chunked prefills
ending off block boundaries, under preemption, on each op set (the reference, the native CPU decode kernel, Triton
under its interpreter); top-20 logprobs within 1e-4 in fp32. The MXFP4 checkpoint is checked against transformers
reading that same checkpoint (it dequantizes MXFP4 itself).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.config import ModelConfig
from engine.model_sources.mxfp4 import released_expert_layout
from engine.models.gpt_oss import read_experts
from engine.parallel.linear import ExpertSharding
from engine.parallel.state import TensorParallel
from tests.hf_oracle import CheckpointDirs, hf_greedy, hf_model, new_llm, tokenizer_of
from tests.models.checkpoints.gpt_oss_models import LAYOUTS, VOCAB, WINDOW, write_gpt_oss_checkpoint
from tests.models.window_parity import (
    GREEDY, NEW_TOKENS, ParityCase, check_chunked_prefill, check_greedy_alone_together_and_hot, check_op_set,
    check_preemption, check_tensor_parallel, check_top20_logprobs, check_varied_and_context,
)


@pytest.fixture(scope="module")
def gpt_oss_dirs(tmp_path_factory) -> dict[str, str]:
    return CheckpointDirs(tmp_path_factory.mktemp("gpt_oss"), write_gpt_oss_checkpoint)


@pytest.fixture(scope="module", params=[pytest.param(layout, marks=() if layout == "bf16" else pytest.mark.slow)
                                        for layout in LAYOUTS])
def case(request, gpt_oss_dirs) -> ParityCase:
    return ParityCase.of(gpt_oss_dirs[request.param], VOCAB, seed=3)


@pytest.mark.slow  # writes the MXFP4 checkpoint too
def test_the_checkpoints_are_the_released_layouts(gpt_oss_dirs):
    from safetensors import safe_open

    for layout, expert_names in (("bf16", ("gate_up_proj", "down_proj")),
                                 ("mxfp4", ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks"))):
        path = Path(gpt_oss_dirs[layout])
        with safe_open(path / "model.safetensors", "pt") as f:
            names = set(f.keys())
        prefix = "model.layers.0."
        assert {prefix + n for n in ("self_attn.sinks", "self_attn.o_proj.bias", "mlp.router.bias",
                                     "mlp.experts.gate_up_proj_bias", "mlp.experts.down_proj_bias")} <= names
        assert {prefix + "mlp.experts." + n for n in expert_names} <= names
        config = json.loads((path / "config.json").read_text())
        assert config["model_type"] == "gpt_oss"
        assert (config.get("quantization_config") or {}).get("quant_method") == (layout if layout == "mxfp4" else None)
    cfg = ModelConfig.from_dir(Path(gpt_oss_dirs["bf16"]))
    assert [cfg.layer_window(i) for i in range(4)] == [WINDOW, None, WINDOW, None]
    assert cfg.attention_sinks and cfg.o_proj_bias and cfg.attention_bias
    assert (cfg.moe.top_k, cfg.moe.scoring, cfg.moe.swiglu_limit, cfg.moe.swiglu_alpha) == (4, "topk_softmax", 7.0,
                                                                                           1.702)
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_scaling["truncate"] is False
    assert (cfg.sliding.rope_theta, cfg.sliding.rope_scaling) == (cfg.rope_theta, cfg.rope_scaling) == (
        150000.0, cfg.rope_scaling)


def test_released_configs_default_to_alternating_windows():
    cfg = ModelConfig.from_dict({"model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880,
                                 "intermediate_size": 2880, "num_hidden_layers": 4, "num_attention_heads": 64,
                                 "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 32,
                                 "num_experts_per_tok": 4, "sliding_window": 128, "rope_theta": 150000,
                                 "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                                  "beta_slow": 1.0, "truncate": False,
                                                  "original_max_position_embeddings": 4096}})
    assert [cfg.layer_window(i) for i in range(4)] == [128, None, 128, None]
    assert cfg.rope_scaling["original_max_position_embeddings"] == 4096 and cfg.moe.num_experts == 32


def test_outputs_are_varied_and_depend_on_the_whole_context(case):
    check_varied_and_context(case, "the full layers")
    long = case.prompts[-1]
    model = hf_model(case.path)
    with torch.no_grad():
        base = model(torch.tensor([long])).logits[0, -1]
        saved = [layer.self_attn.sinks.clone() for layer in model.model.layers]
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(-1e4)
        assert (model(torch.tensor([long])).logits[0, -1] - base).abs().max() > 0.05, "the sinks matter"
        for layer, sinks in zip(model.model.layers, saved):
            layer.self_attn.sinks.copy_(sinks)


@pytest.mark.parametrize("block_size", [4, pytest.param(16, marks=pytest.mark.slow)])
def test_greedy_one_at_a_time_all_together_and_cache_hot(case, block_size):
    check_greedy_alone_together_and_hot(case, block_size)


@pytest.mark.slow
def test_chunked_prefill_ending_off_block_boundaries(case):
    check_chunked_prefill(case)


@pytest.mark.slow
def test_preemption_in_a_small_pool(case):
    check_preemption(case)


def test_top20_logprobs_within_1e_4(case):
    check_top20_logprobs(case)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("case", ["bf16"], indirect=True)
def test_other_op_sets_chunked_and_together(case, backend):
    """The pure-torch reference and the Triton kernels (sinks in the attention kernel, expert biases around the
    grouped GEMMs)."""
    check_op_set(case, backend)


def test_each_rank_reads_its_share_of_the_experts():
    """Under tensor parallelism 2 the ranks' expert tensors put back together are the one-rank values: halves of the
    intermediate dim (48 columns: MXFP4's down_proj groups of 32 cut mid-group), the down bias on rank 0 only; under
    expert parallelism half the experts each."""
    experts, hidden, inter = 4, 64, 96
    gen = torch.Generator().manual_seed(0)
    shapes = {"gate_up_proj": (experts, hidden, 2 * inter), "gate_up_proj_bias": (experts, 2 * inter),
              "down_proj": (experts, inter, hidden), "down_proj_bias": (experts, hidden)}
    stored = {f"x.mlp.experts.{name}": torch.randn(*shape, generator=gen) for name, shape in shapes.items()}
    for layout in (stored, released_expert_layout(stored)):
        tensors = {name.rsplit(".", 1)[1]: t for name, t in layout.items()}

        def read(name: str, tp: TensorParallel) -> torch.Tensor:
            return read_experts(name, lambda t, index: tensors[t][index], ExpertSharding(tp, experts, inter))

        for name in (n for n in tensors if not n.endswith("_scales")):
            whole = read(name, TensorParallel())
            ranks = [read(name, TensorParallel(rank, 2)) for rank in (0, 1)]
            whole_experts = [read(name, TensorParallel(rank, 2, expert_parallel=True)) for rank in (0, 1)]
            assert torch.equal(torch.cat(whole_experts), whole), name
            if name == "down_proj_bias":
                assert torch.equal(ranks[0], whole) and not ranks[1].any()
            elif name.startswith("gate_up_proj"):  # each rank: its gate rows, then its up rows
                halves = [r.chunk(2, dim=1) for r in ranks]
                assert torch.equal(torch.cat([halves[0][0], halves[1][0], halves[0][1], halves[1][1]], dim=1), whole)
            else:
                assert torch.equal(torch.cat(ranks, dim=-1), whole), name


@pytest.mark.slow
@pytest.mark.parametrize(("case", "expert_parallel"), [("bf16", False), ("mxfp4", True)], indirect=["case"])
def test_tensor_parallel_2_equals_transformers(case, expert_parallel):
    """Two ranks of 2 query heads and their sinks, 1 KV head, o_proj's bias added once, the router replicated; the
    experts either each cut in half along the intermediate dim (the gate/up bias sliced with it, the down bias added
    once), or 4 whole experts a rank, read from the MXFP4 blocks of those experts only."""
    # 4, 17 and 70 tokens: the two longer ones reach past the window
    check_tensor_parallel(case, slice(1, 6, 2), enable_expert_parallel=expert_parallel)


@pytest.mark.slow  # builds gpt-oss-tiny (~30 s: the o200k_harmony merges, 201,088-row embeddings)
def test_the_registry_model_is_the_released_layout_and_equals_transformers_on_harmony_prompts():
    """gpt-oss-tiny: MXFP4 experts as gpt-oss-20b ships them, the o200k_harmony tokenizer; on prompts rendered in the
    harmony format (a system message with tools, a user turn, a tool loop) greedy tokens equal transformers' reading
    the same directory, and differ between prompts."""
    from safetensors import safe_open

    from engine.registry import resolve_model
    from server.rendering import get_renderer
    from tests.rendering.test_harmony_rendering import CONVERSATIONS

    path = resolve_model("gpt-oss-tiny")
    assert json.loads((path / "config.json").read_text())["quantization_config"]["quant_method"] == "mxfp4"
    with safe_open(path / "model.safetensors", "pt") as f:
        assert "model.layers.0.mlp.experts.gate_up_proj_blocks" in set(f.keys())
    tokenizer = tokenizer_of(str(path))
    assert len(tokenizer) == 201_088
    renderer = get_renderer("gpt-oss")
    prompts = [tokenizer.encode(renderer.render(messages, tools), add_special_tokens=False)
               for messages, tools, _ in (CONVERSATIONS[name] for name in ("plain", "tools_high", "loop_open"))]
    expected = [hf_greedy(str(path), p, NEW_TOKENS) for p in prompts]
    outs = new_llm("gpt-oss-tiny", block_size=16, num_kv_blocks=256).generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == expected and len({tuple(e) for e in expected}) == len(expected)
