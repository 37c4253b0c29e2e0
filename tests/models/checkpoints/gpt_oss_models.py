"""Tiny gpt-oss checkpoints (``GptOssForCausalLM``) written by transformers' own ``save_pretrained``, in both released
layouts: ``bf16`` (the stacked experts as transformers holds them: ``gate_up_proj`` ``[E, H, 2I]`` interleaved,
``down_proj`` ``[E, I, H]``) and ``mxfp4`` (gpt-oss-20b's: the expert weights as ``*_blocks`` / ``*_scales``, with
``quantization_config: {quant_method: mxfp4}``). The two hold the same values: the experts are drawn, quantized to
MXFP4 and written back dequantized (by transformers' own ``convert_moe_packed_tensors``) into the model the ``bf16``
directory saves, so that one transformers model is the oracle of both.

Window layers alternate with full ones (window 8, prompts up to 70 tokens), attention sinks and every bias are drawn
with the tiny models' scales (engine/model_sources/tiny.py) so that greedy continuations are varied."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from engine.model_sources.mxfp4 import QUANTIZATION_CONFIG, quantize_mxfp4, released_expert_layout
from engine.model_sources.tiny import InitScales, random_tensor
from engine.registry import resolve_model

LAYOUTS = ("bf16", "mxfp4")
VOCAB = 8192
WINDOW = 8
CONFIG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=4, sliding_window=WINDOW,
              max_position_embeddings=4096, eos_token_id=2, pad_token_id=0)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")  # the tests work on token ids: any real tokenizer


def hf_gpt_oss_model(seed: int = 29, **overrides):
    """The transformers model with the tiny models' weight scales; its expert weights exactly MXFP4 values."""
    import transformers as tf
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    model = tf.GptOssForCausalLM(tf.GptOssConfig(**{**CONFIG, **overrides}))
    with torch.no_grad():
        for name, param in model.named_parameters():
            value = random_tensor(name, tuple(param.shape), seed, InitScales())
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # exactly MXFP4 values
                value = convert_moe_packed_tensors(*quantize_mxfp4(value.transpose(1, 2)), dtype=torch.float32)
            param.copy_(value)
    return model.eval()


def write_gpt_oss_checkpoint(layout: str, out: Path, **overrides) -> Path:
    """``save_pretrained`` of `hf_gpt_oss_model`; with ``mxfp4`` its expert weights rewritten as the release stores
    them, beside the Qwen3 tokenizer's files. Returns ``out``."""
    from safetensors.torch import load_file, save_file

    hf_gpt_oss_model(**overrides).save_pretrained(out)
    for name in TOKENIZER_FILES:
        shutil.copyfile(resolve_model("qwen3-tiny") / name, out / name)
    if layout == "mxfp4":
        path = out / "model.safetensors"
        save_file(released_expert_layout(load_file(path)), str(path), metadata={"format": "pt"})
        config = json.loads((out / "config.json").read_text())
        config["quantization_config"] = QUANTIZATION_CONFIG
        (out / "config.json").write_text(json.dumps(config, indent=2))
    elif layout != "bf16":
        raise ValueError(f"unknown gpt-oss layout {layout!r}; one of {LAYOUTS}")
    return out
