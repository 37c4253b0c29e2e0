"""A tiny Kimi Linear checkpoint in the released layout (moonshotai/Kimi-Linear-48B-A3B-Instruct's names and
config.json keys), written by transformers' own ``save_pretrained`` with the tiny models' weight scales: KDA and MLA
layers (``linear_attn_config``: 1-indexed full-attention and KDA layers), a dense first layer, then a shared
expert beside top-2 of 8 sigmoid-routed experts. transformers saves every MLP under ``block_sparse_moe`` (its
conversion mapping renames both ways); the release keeps the dense layer's as ``mlp``, which is restored here."""
from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file, save_file

from tests.models.checkpoints.hybrid_models import randomized, save_with_tokenizer

VOCAB = 151936  # the stand-in Qwen3 tokenizer's
_LINEAR = {"full_attn_layers": [2, 4], "kda_layers": [1, 3, 5], "num_heads": 4, "head_dim": 16,
           "short_conv_kernel_size": 4}
# the released config.json's keys (transformers reads them through KimiLinearConfig's attribute map)
_CONFIG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=5,
               num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16,
               qk_rope_head_dim=8, v_head_dim=16, num_experts=8, num_experts_per_token=2, num_shared_experts=1,
               moe_renormalize=True, num_expert_group=1, topk_group=1, routed_scaling_factor=2.446,
               first_k_dense_replace=1, moe_layer_freq=1, moe_router_activation_func="sigmoid", use_grouped_topk=True,
               mla_use_nope=True, model_max_length=1048576, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
               tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645, pad_token_id=151643,
               linear_attn_config=_LINEAR)


def released_config() -> dict:
    """config.json as the release writes it, at the tiny sizes."""
    return {"architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", **_CONFIG}


def hf_kimi_linear(seed: int = 29):
    import transformers as tf

    config = tf.KimiLinearConfig(**{k: v for k, v in _CONFIG.items() if k != "linear_attn_config"},
                                 linear_attn_config=_LINEAR)
    return randomized(tf.KimiLinearForCausalLM(config), seed)


def write_kimi_linear_checkpoint(out: Path) -> Path:
    """The checkpoint plus the Qwen3 tokenizer files (a stand-in: no package ships Kimi's); returns ``out``."""
    save_with_tokenizer(hf_kimi_linear(), out, "qwen3-tiny")
    path = out / "model.safetensors"
    tensors = {name.replace(".0.block_sparse_moe.", ".0.mlp."): t for name, t in load_file(path).items()}
    save_file(tensors, str(path), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    for key in ("layer_types", "mlp_layer_types", "linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim"):
        config.pop(key, None)  # the release says them in linear_attn_config and first_k_dense_replace
    (out / "config.json").write_text(json.dumps({**config, **released_config()}, indent=2))
    return out
