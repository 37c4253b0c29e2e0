"""Muse-Glimmer on a tiny random checkpoint written by transformers' own save_pretrained, in the released layout
(MuseGlimmerForConditionalGeneration: the language model beside a vision tower and its adapter; transformers has no
text-only causal LM for it, so the oracle is that model).

Eight layers: three window layers (8 tokens) to one full-attention layer without RoPE, twice, so every prompt but the
shortest reaches past the window and the NoPE layers carry what lies beyond it. Greedy tokens equal transformers' one
prompt at a time, all together, with the prefix cache hot, with chunked prefills ending off block boundaries, under
preemption and over two tensor-parallel ranks; top-20 logprobs within 1e-4 in fp32. The tokenizer is the real Qwen3
one (the tests work on token ids).
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from engine.config import ModelConfig
from engine.model_sources.tiny import family_scales, random_tensor
from tests.hf_oracle import new_llm, saved_with_tokenizer
from tests.models.window_parity import (
    ParityCase, check_chunked_prefill, check_greedy_alone_together_and_hot, check_preemption, check_registry_model,
    check_tensor_parallel, check_top20_logprobs, check_varied_and_context,
)

VOCAB = 151936  # the Qwen3 tokenizer's
WINDOW = 8
_TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, sliding_window=WINDOW,
             eos_token_id=151645, pad_token_id=0, bos_token_id=151643)
_VISION = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2)


def hf_muse_glimmer_model(seed: int = 31):
    """transformers' model with the tiny models' weight scales (`family_scales`)."""
    import transformers as tf

    config = tf.MuseGlimmerConfig(text_config=_TEXT, vision_config=_VISION, out_hidden_size=128,
                                  projector_hidden_size=64)
    model = tf.MuseGlimmerForConditionalGeneration(config)
    scales, zero_centered = family_scales("muse_glimmer")
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(random_tensor(name, tuple(param.shape), seed, scales, zero_centered_norms=zero_centered))
    return model.eval()


@pytest.fixture(scope="module")
def muse_dir(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("muse_glimmer") / "muse_glimmer"
    saved_with_tokenizer(lambda _: hf_muse_glimmer_model())("muse_glimmer", out)
    return str(out)


@pytest.fixture(scope="module")
def case(muse_dir) -> ParityCase:
    return ParityCase.of(muse_dir, VOCAB, seed=5)


@pytest.mark.slow  # the names and config only: the parity tests load the same checkpoint
def test_the_checkpoint_is_the_released_layout(muse_dir):
    from safetensors import safe_open

    assert json.loads((Path(muse_dir) / "config.json").read_text())["model_type"] == "muse_glimmer"
    with safe_open(Path(muse_dir) / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert {"lm_head.weight", "model.language_model.layers.0.self_attn.gate_proj.weight"} <= names
    assert any(n.startswith("model.vision_tower.") for n in names)
    cfg = ModelConfig.from_dir(Path(muse_dir))
    assert [cfg.layer_window(i) for i in range(8)] == ([WINDOW] * 3 + [None]) * 2
    assert cfg.muse_glimmer.nope_layers == (3, 7) and cfg.has_vision_tower and not cfg.tie_word_embeddings
    assert (cfg.final_logit_softcapping, cfg.muse_glimmer.qk_scale_factor) == (20.0, 3.87)


@pytest.mark.slow  # the fast tier keeps the greedy check on the same checkpoint
def test_outputs_are_varied_and_depend_on_the_whole_context(case):
    check_varied_and_context(case, "the full NoPE layers")


@pytest.mark.parametrize("block_size", [4, pytest.param(16, marks=pytest.mark.slow)])
def test_greedy_one_at_a_time_all_together_and_cache_hot(case, block_size):
    check_greedy_alone_together_and_hot(case, block_size)


@pytest.mark.slow
def test_chunked_prefill_ending_off_block_boundaries(case):
    check_chunked_prefill(case)


@pytest.mark.slow
def test_preemption_in_a_small_pool(case):
    check_preemption(case)


@pytest.mark.slow  # tests/models/test_gemma4.py keeps a fast top-20 check of the same normalized attention
def test_top20_logprobs_within_1e_4(case):
    check_top20_logprobs(case)


@pytest.mark.slow  # loads a model of its own
def test_vision_tower_skipped_with_one_log_line(muse_dir, caplog):
    with caplog.at_level(logging.INFO, logger="engine.weights"):
        llm = new_llm(muse_dir, block_size=4, num_kv_blocks=64)
    assert sum("vision tower" in r.message for r in caplog.records) == 1
    assert not any("vision" in name for name, _ in llm.engine.runner.model.named_parameters())


@pytest.mark.slow
def test_tensor_parallel_2(case):
    """Two gloo ranks: each holds half the query heads and their output gates, one of the two KV heads, half the
    MLPs and half the vocabulary."""
    check_tensor_parallel(case)


def test_the_engines_pages_of_muse_glimmer_30b_are_the_documented_bytes_per_token():
    """Muse-Glimmer-30B's text config (transformers' defaults: 52 layers, window 2048, every fourth a full NoPE layer,
    2 KV heads of 128) built on the meta device: its cache spec keeps what docs/SLIDING_WINDOW.md prices."""
    from benchmarks.prefix.policies.sliding_window import SHAPES
    from engine.models.architectures import MODEL_CLASSES

    text = dict(vocab_size=202048, hidden_size=6656, intermediate_size=19968, num_hidden_layers=52,
                num_attention_heads=32, num_key_value_heads=2, head_dim=128, sliding_window=2048,
                rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    cfg = ModelConfig.from_dict({"model_type": "muse_glimmer", "text_config": text, "vision_config": {}})
    assert len(cfg.muse_glimmer.nope_layers) == 13 and cfg.muse_glimmer.nope_layers[-1] == 51
    with torch.device("meta"):
        spec = MODEL_CLASSES[cfg.architecture](cfg, ops=None).kv_cache_spec()
    shape = SHAPES["Muse-Glimmer-30B"]
    assert (spec.window, spec.num_window_layers) == (shape.window, shape.window_layers)
    assert spec.bytes_per_token(torch.bfloat16) == shape.dense_bytes_per_token
    assert spec.window_bytes_per_block(1, torch.bfloat16) == shape.window_bytes_per_token


@pytest.mark.slow
def test_registry_muse_glimmer_tiny_matches_transformers():
    """The registry's muse-glimmer-tiny (the released VLM layout with a tiny vision tower, a 16-token window, random
    weights, Qwen3's tokenizer as a stand-in): greedy tokens of varied continuations equal transformers' in steps
    that mix chunked prefills with decodes."""
    assert check_registry_model("muse-glimmer-tiny", VOCAB).engine.model_cfg.muse_glimmer.nope_layers == (3, 7)
