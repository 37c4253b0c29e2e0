"""Tiny hybrid checkpoints written by transformers' own ``save_pretrained``, in the released layouts: Qwen3.5 / 3.6
(``Qwen3_5ForConditionalGeneration``: the language model under ``model.language_model.*`` beside a vision tower),
Qwen3.5-MoE (the same, with MoE MLPs and a gated shared expert) and Qwen3-Next (``Qwen3NextForCausalLM``, grouped
projections). Weights are drawn with the tiny models' scales (engine/model_sources/tiny.py) so that greedy outputs
are varied; the tokenizer is the real Qwen3 one."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

from engine.model_sources.tiny import InitScales, random_tensor
from engine.registry import resolve_model

KINDS = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
_TEXT = dict(vocab_size=151936, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=32, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
             linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=40960, tie_word_embeddings=False,
             eos_token_id=151645)
_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=16,
               num_position_embeddings=64)
_ROPE = dict(rope_type="default", rope_theta=1e6, partial_rotary_factor=0.25, mrope_section=[2, 1, 1],
             mrope_interleaved=True)


def hf_hybrid_model(kind: str, seed: int = 17):
    """The transformers model of ``kind`` with the tiny models' weight scales."""
    import transformers as tf

    if kind == "qwen3_5":
        model = tf.Qwen3_5ForConditionalGeneration(tf.Qwen3_5Config(
            text_config=dict(_TEXT, intermediate_size=128, rope_parameters=_ROPE), vision_config=_VISION))
    elif kind == "qwen3_5_moe":
        model = tf.Qwen3_5MoeForConditionalGeneration(tf.Qwen3_5MoeConfig(
            text_config=dict(_TEXT, **_MOE, rope_parameters=_ROPE), vision_config=_VISION))
    elif kind == "qwen3_next":
        model = tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(**_TEXT, intermediate_size=128, **_MOE,
                                                           rope_parameters=dict(rope_type="default", rope_theta=1e6,
                                                                                           partial_rotary_factor=0.25)))
    else:
        raise ValueError(f"unknown hybrid kind {kind!r}; one of {KINDS}")
    return randomized(model, seed)


def randomized(model, seed: int):
    """``model`` with the tiny models' weight scales, in eval mode (a vision tower's LayerNorms are ordinary ones,
    the language model's norms zero-centred)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(random_tensor(name, tuple(param.shape), seed, InitScales(),
                                      zero_centered_norms=".visual." not in name))
    return model.eval()


def save_with_tokenizer(model, out: Path, tokenizer_model: str) -> Path:
    """``save_pretrained`` of ``model`` plus the tokenizer files of the registry's ``tokenizer_model``; returns
    ``out``."""
    model.save_pretrained(out)
    tokenizer_dir = resolve_model(tokenizer_model)
    for name in TOKENIZER_FILES:
        shutil.copyfile(tokenizer_dir / name, out / name)
    return out


def write_hybrid_checkpoint(kind: str, out: Path) -> Path:
    """``save_pretrained`` of `hf_hybrid_model` plus the Qwen3 tokenizer files; returns ``out``."""
    return save_with_tokenizer(hf_hybrid_model(kind), out, "qwen3-tiny")
