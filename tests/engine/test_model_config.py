"""config.json of the real MoE / MLA checkpoints -> ModelConfig, model shapes and KV bytes per token; YaRN RoPE and
MLA's softmax scale equal transformers' for DeepSeek and Qwen3 configs."""
from __future__ import annotations

import math

import pytest
import torch

from engine.config import ModelConfig
from engine.models.architectures import MODEL_CLASSES
from engine.models.mla import MLAAttention
from engine.models.rope import build_cos_sin_cache
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
