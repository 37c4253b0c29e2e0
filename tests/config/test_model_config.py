"""config.json of the real MoE / MLA checkpoints -> ModelConfig, model shapes and KV bytes per token; YaRN RoPE and
MLA's softmax scale equal transformers' for DeepSeek and Qwen3 configs."""
from __future__ import annotations

import copy
import math

import pytest
import torch

from engine.config import ModelConfig
from engine.models.architectures import MODEL_CLASSES
from engine.models.layers.mla import MLAAttention
from engine.models.layers.rope import build_cos_sin_cache
from engine.parallel.state import SINGLE
from kernels.ops import TORCH_OPS

# The config.json keys that matter, as published (Qwen/Qwen3-30B-A3B, deepseek-ai/DeepSeek-V3,
# deepseek-ai/DeepSeek-V2-Lite-Chat).
QWEN3_30B_A3B = {
    "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
    "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rope_scaling": None,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "eos_token_id": 151645,
}
DEEPSEEK_V3 = {
    "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4,
    "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True, "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 3, "moe_layer_freq": 1, "max_position_embeddings": 163840, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1,
}
DEEPSEEK_V2_LITE = {
    "model_type": "deepseek_v2", "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944,
    "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16,
    "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6, "n_group": 1, "topk_group": 1,
    "topk_method": "greedy", "scoring_func": "softmax", "norm_topk_prob": False, "routed_scaling_factor": 1.0,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "max_position_embeddings": 163840, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
}


# DeepSeek-V3.2: V3 plus the indexer's sizes. DeepSeek-V4-Flash, in the keys its checkpoint's config carries
# (compress_ratios per layer, num_hash_layers, qk_rope_head_dim, a flat YaRN rope_scaling for the compressed layers):
# two sliding-only layers, then compressed sparse and heavily compressed attention alternating; 284B parameters.
DEEPSEEK_V32 = {**DEEPSEEK_V3, "model_type": "deepseek_v32", "index_n_heads": 64, "index_head_dim": 128,
                "index_topk": 2048}
DEEPSEEK_V4_FLASH = {
    "model_type": "deepseek_v4", "vocab_size": 129280, "hidden_size": 4096, "moe_intermediate_size": 2048,
    "num_hidden_layers": 43, "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512,
    "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024, "n_routed_experts": 256,
    "n_shared_experts": 1, "num_experts_per_tok": 6, "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5,
    "num_hash_layers": 3, "compress_ratios": [0, 0] + [4, 128] * 20 + [4], "sliding_window": 128,
    "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512, "hc_mult": 4, "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6, "rope_theta": 10000, "compress_rope_theta": 160000, "swiglu_limit": 10.0,
    "max_position_embeddings": 1048576, "rope_scaling": {"type": "yarn", "factor": 16, "beta_fast": 32,
                                                         "beta_slow": 1, "original_max_position_embeddings": 65536},
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1,
}


def _meta_model(config: dict):
    cfg = ModelConfig.from_dict(config)
    with torch.device("meta"):
        return MODEL_CLASSES[cfg.architecture](cfg, TORCH_OPS)


def _params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def test_qwen3_30b_a3b() -> None:
    cfg = ModelConfig.from_dict(QWEN3_30B_A3B)
    assert cfg.mla is None and cfg.qk_norm and cfg.moe.moe_layers == tuple(range(48))
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.scoring, cfg.moe.norm_topk_prob) == (128, 8, "softmax", True)
    model = _meta_model(QWEN3_30B_A3B)
    assert _params(model) == pytest.approx(30.5e9, rel=0.01)  # "30B total, 3B active"
    assert model.kv_cache_spec().bytes_per_token(torch.bfloat16) == 48 * 2 * 4 * 128 * 2  # 96 KiB per token


def test_qwen3_moe_sparse_step_and_dense_layers() -> None:
    cfg = ModelConfig.from_dict({**QWEN3_30B_A3B, "num_hidden_layers": 6, "decoder_sparse_step": 2,
                                 "mlp_only_layers": [3]})
    assert cfg.moe.moe_layers == (1, 5)
    renamed = {k: v for k, v in QWEN3_30B_A3B.items() if k != "num_experts"} | {"num_local_experts": 128}
    assert ModelConfig.from_dict(renamed).moe.num_experts == 128  # as transformers 5 saves it


def test_deepseek_v3() -> None:
    cfg = ModelConfig.from_dict(DEEPSEEK_V3)
    moe, mla = cfg.moe, cfg.mla
    assert moe.moe_layers == tuple(range(3, 61)) and moe.num_shared_experts == 1
    assert (moe.scoring, moe.correction_bias, moe.n_group, moe.topk_group, moe.group_score) == (
        "sigmoid", True, 8, 4, "top2_sum")
    assert moe.routed_scaling_factor == 2.5 and moe.norm_topk_prob
    assert (mla.q_lora_rank, mla.kv_lora_rank, mla.qk_rope_head_dim, mla.rope_interleave) == (1536, 512, 64, True)
    assert cfg.rope_scaling["factor"] == 40
    model = _meta_model(DEEPSEEK_V3)
    assert _params(model) == pytest.approx(671e9, rel=0.01)
    spec = model.kv_cache_spec()
    assert spec.bytes_per_token(torch.bfloat16) == 61 * 576 * 2  # one 576-value latent row per layer
    gqa_equivalent = 61 * 128 * (192 + 128) * 2  # the decompressed K (nope + rope) and V of every head
    assert spec.bytes_per_token(torch.bfloat16) < gqa_equivalent / 60


def test_deepseek_v32() -> None:
    cfg = ModelConfig.from_dict(DEEPSEEK_V32)
    assert (cfg.indexer.num_heads, cfg.indexer.head_dim, cfg.indexer.topk) == (64, 128, 2048)
    assert cfg.moe.moe_layers == tuple(range(3, 61)) and cfg.moe.correction_bias
    spec = _meta_model(DEEPSEEK_V32).kv_cache_spec()
    assert spec.bytes_per_token(torch.bfloat16) == 61 * (576 + 128) * 2  # the latent row and the index key


def test_deepseek_v4_flash() -> None:
    """The legacy keys read as transformers reads them; 284B parameters; its pages per token at block 128."""
    from transformers import DeepseekV4Config

    cfg = ModelConfig.from_dict(DEEPSEEK_V4_FLASH)
    v4, moe = cfg.v4, cfg.moe
    hf = DeepseekV4Config(**copy.deepcopy(DEEPSEEK_V4_FLASH))  # it normalizes the rope dicts in place
    rate_of = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
    assert v4.compress_rates == tuple(rate_of[kind] for kind in hf.layer_types)
    assert (v4.rope_dim, v4.sliding_window, v4.index_topk, v4.hc_mult) == (hf.qk_rope_head_dim, 128, 512, 4)
    assert moe.hash_layers == tuple(i for i, kind in enumerate(hf.mlp_layer_types) if kind == "hash_moe") == (0, 1, 2)
    assert (moe.scoring, moe.top_k, moe.swiglu_limit, moe.moe_layers) == ("sqrtsoftplus", 6, 10.0, tuple(range(43)))
    model = _meta_model(DEEPSEEK_V4_FLASH)
    assert _params(model) == pytest.approx(284e9, rel=0.01)
    # every layer's keys (512), plus per token on a CSA layer 128 + 32 entry values and 45 floats of pooling state,
    # on an HCA layer 4 entry values and 12 floats of state
    per_token = 43 * 512 * 2 + 21 * ((128 + 32) * 2 + 45 * 4) + 20 * (4 * 2 + 12 * 4)
    assert model.kv_cache_spec().bytes_per_token(torch.bfloat16, 128) == per_token == 55_652


def test_deepseek_v4_rope_equals_transformers() -> None:
    """Sliding-only layers: plain RoPE at rope_theta; compressed layers: YaRN at compress_rope_theta without YaRN's
    magnitude factor; both on the last qk_rope_head_dim dims in interleaved pairs."""
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding, apply_rotary_pos_emb

    from engine.models.layers.rope import rotate_pairs

    hf_rope = DeepseekV4RotaryEmbedding(DeepseekV4Config(**copy.deepcopy(DEEPSEEK_V4_FLASH)))
    model = _meta_model(DEEPSEEK_V4_FLASH)
    model.init_rope(200_000, torch.device("cpu"))
    positions = torch.tensor([0, 1, 127, 500])  # transformers computes angles in fp32: 2e-4 off by 4096
    x = torch.randn(len(positions), 2, 512, generator=torch.Generator().manual_seed(0))
    for kind in ("main", "compress"):
        cos, sin = hf_rope(x, positions[None], layer_type=kind)
        expected = apply_rotary_pos_emb(x[None].transpose(1, 2), cos, sin).transpose(1, 2)[0]
        torch.testing.assert_close(rotate_pairs(x, positions, model.cos_sin[kind]), expected, atol=1e-4, rtol=0)


def test_deepseek_v2_lite() -> None:
    cfg = ModelConfig.from_dict(DEEPSEEK_V2_LITE)
    moe = cfg.moe
    assert (moe.scoring, moe.correction_bias, moe.n_group, moe.norm_topk_prob) == ("softmax", False, 1, False)
    assert moe.num_shared_experts == 2 and moe.moe_layers == tuple(range(1, 27))
    assert cfg.mla.q_lora_rank is None
    assert _params(_meta_model(DEEPSEEK_V2_LITE)) == pytest.approx(15.7e9, rel=0.01)


def test_unsupported_routing_is_refused() -> None:
    with pytest.raises(ValueError, match="not supported"):
        ModelConfig.from_dict({**DEEPSEEK_V3, "scoring_func": "sqrtsoftplus"})


def _small(config: dict, **overrides) -> dict:
    return {**config, "num_hidden_layers": 1, "n_routed_experts": 8, "num_experts": 8, "vocab_size": 64,
            **overrides}


def _frequencies_and_magnitude(cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A cos/sin table's inverse frequencies (the angle at position 1) and magnitude (cos at position 0).

    Compared through these rather than at large positions, where transformers' fp32 angles drift by 1e-3."""
    half = cos_sin.shape[-1] // 2
    return torch.atan2(cos_sin[1, half:], cos_sin[1, :half]), cos_sin[0, :half]


@pytest.mark.parametrize("config", [DEEPSEEK_V3, DEEPSEEK_V2_LITE], ids=["v3", "v2-lite"])
def test_deepseek_yarn_rope_and_softmax_scale_equal_transformers(config: dict) -> None:
    from transformers import AutoConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    config = _small(config, rope_scaling={**config["rope_scaling"], "mscale_all_dim": 0.8})  # both factors != 1
    hf_config = AutoConfig.for_model("deepseek_v3", **{k: v for k, v in config.items() if k != "model_type"})
    hf = DeepseekV3RotaryEmbedding(hf_config)
    cfg = ModelConfig.from_dict(config)
    inv_freq, magnitude = _frequencies_and_magnitude(build_cos_sin_cache(64, 2, cfg.rope_theta, cfg.rope_scaling))
    torch.testing.assert_close(inv_freq, hf.inv_freq, atol=1e-9, rtol=1e-6)
    assert hf.attention_scaling != 1 and torch.allclose(magnitude, torch.tensor(hf.attention_scaling), rtol=1e-6)
    with torch.device("meta"):
        expected_scale = DeepseekV3Attention(hf_config, 0).scaling
        assert MLAAttention(cfg, SINGLE).scale == pytest.approx(expected_scale, rel=1e-12)


def test_qwen3_yarn_rope_equals_transformers() -> None:
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    config = {"model_type": "qwen3", "vocab_size": 64, "hidden_size": 64, "intermediate_size": 64,
              "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128,
              "max_position_embeddings": 131072, "rope_theta": 1000000.0,
              "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
    hf = Qwen3RotaryEmbedding(Qwen3Config(**{k: v for k, v in config.items() if k != "model_type"}))
    cfg = ModelConfig.from_dict(config)
    inv_freq, magnitude = _frequencies_and_magnitude(build_cos_sin_cache(128, 2, cfg.rope_theta, cfg.rope_scaling))
    torch.testing.assert_close(inv_freq, hf.inv_freq, atol=1e-9, rtol=1e-6)
    assert hf.attention_scaling == pytest.approx(0.1 * math.log(4.0) + 1)
    assert torch.allclose(magnitude, torch.tensor(hf.attention_scaling), rtol=1e-6)
