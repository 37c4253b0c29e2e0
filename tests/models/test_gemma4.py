"""Gemma 4 on tiny random checkpoints written by transformers' own save_pretrained, in the released layouts:
``gemma4`` (Gemma4ForConditionalGeneration, as Gemma-4-31B: the language model beside a vision tower, global layers
whose values come from k_proj), ``gemma4_text`` (Gemma4ForCausalLM, global layers with a v_proj of their own) and
``gemma4_moe`` (Gemma4ForCausalLM with 26B-A4B's MoE block: top-2 of 4 GELU experts beside every dense MLP).

Five window layers to one global layer, windows of 8 or 12 tokens, so every prompt but the shortest reaches past
them; the global layers have heads twice as wide and one or two KV heads, proportional RoPE. Greedy tokens equal
transformers' one prompt at a time, all together, with the prefix cache hot, with chunked prefills ending off block
boundaries, under preemption and over two tensor-parallel ranks; top-20 logprobs within 1e-4 in fp32. The weights
use the tiny models' scales (engine/model_sources/tiny.py), the layer scalars drawn around 1; the tokenizer is the
real Qwen3 one (the tests work on token ids).
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from engine.config import ModelConfig
from engine.model_sources.tiny import family_scales, random_tensor
from tests.hf_oracle import CheckpointDirs, new_llm, saved_with_tokenizer
from tests.models.window_parity import (
    ParityCase, check_chunked_prefill, check_greedy_alone_together_and_hot, check_preemption, check_registry_model,
    check_tensor_parallel, check_top20_logprobs, check_varied_and_context,
)

KINDS = ("gemma4", "gemma4_text", "gemma4_moe")
VOCAB = 151936  # the Qwen3 tokenizer's
WINDOW = {"gemma4": 8, "gemma4_text": 12, "gemma4_moe": 8}
_TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, global_head_dim=32, max_position_embeddings=4096,
             hidden_size_per_layer_input=0, eos_token_id=151645, pad_token_id=0, bos_token_id=151643)
# Gemma-4-31B's layout: the global layers' values come from k_proj, with fewer KV heads
_K_EQ_V = dict(attention_k_eq_v=True, num_global_key_value_heads=1)
_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
               head_dim=16, patch_size=8, position_embedding_size=64)


def hf_gemma4_model(kind: str, seed: int = 29):
    """The transformers model of ``kind`` with the tiny models' weight scales (plain norm gains) and layer scalars
    drawn around 1, so that loading and applying them shows."""
    import transformers as tf

    if kind == "gemma4":
        text = tf.Gemma4TextConfig(**_TEXT, **_K_EQ_V, sliding_window=WINDOW[kind])
        model = tf.Gemma4ForConditionalGeneration(tf.Gemma4Config(
            text_config=text, vision_config=tf.Gemma4VisionConfig(**_VISION), audio_config=None))
    elif kind == "gemma4_text":  # with the final logit softcap as well
        model = tf.Gemma4ForCausalLM(tf.Gemma4TextConfig(**_TEXT, sliding_window=WINDOW[kind],
                                                         final_logit_softcapping=4.0))
    elif kind == "gemma4_moe":  # 26B-A4B's layout: top-2 of 4 GELU experts beside every dense MLP
        model = tf.Gemma4ForCausalLM(tf.Gemma4TextConfig(**_TEXT, **_K_EQ_V, sliding_window=WINDOW[kind],
                                                         enable_moe_block=True, num_experts=4, top_k_experts=2,
                                                         moe_intermediate_size=32))
    else:
        raise ValueError(kind)
    scales, _ = family_scales("gemma4")
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(random_tensor(name, tuple(param.shape), seed, scales))
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.copy_(random_tensor(name, (1,), seed, scales))
    return model.eval()


@pytest.fixture(scope="module")
def gemma4_dirs(tmp_path_factory) -> dict[str, str]:
    return CheckpointDirs(tmp_path_factory.mktemp("gemma4"), saved_with_tokenizer(hf_gemma4_model))


SWEEP = [pytest.param(kind, marks=() if kind == "gemma4" else pytest.mark.slow) for kind in KINDS]


@pytest.fixture(scope="module", params=SWEEP)
def case(request, gemma4_dirs) -> ParityCase:
    return ParityCase.of(gemma4_dirs[request.param], VOCAB, seed=len(request.param))


@pytest.mark.slow  # writes the gemma4_text checkpoint too
def test_the_checkpoints_are_the_released_layouts(gemma4_dirs):
    from safetensors import safe_open

    for kind, prefix in (("gemma4", "model.language_model.layers."), ("gemma4_text", "model.layers.")):
        path = Path(gemma4_dirs[kind])
        assert json.loads((path / "config.json").read_text())["model_type"] == kind
        with safe_open(path / "model.safetensors", "pt") as f:
            names = set(f.keys())
        assert {prefix + n for n in ("0.layer_scalar", "5.self_attn.k_proj.weight", "0.self_attn.v_proj.weight")} <= names
        assert (prefix + "5.self_attn.v_proj.weight" in names) == (kind == "gemma4_text")
        assert (kind == "gemma4") == any(n.startswith("model.vision_tower.") for n in names)
        cfg = ModelConfig.from_dir(path)
        assert [cfg.layer_window(i) for i in range(6)] == [WINDOW[kind]] * 5 + [None]
        assert cfg.gemma4.head_dims == (16,) * 5 + (32,) and cfg.gemma4.k_eq_v == (kind == "gemma4")
        assert cfg.gemma4.kv_heads == (2,) * 5 + ((1,) if kind == "gemma4" else (2,))
        assert not cfg.zero_centered_norms and cfg.tie_word_embeddings and cfg.has_vision_tower == (kind == "gemma4")
        assert (cfg.rope_theta, cfg.sliding.rope_theta) == (1e6, 1e4)
        assert cfg.rope_scaling == {"rope_type": "proportional", "partial_rotary_factor": 0.25}


@pytest.mark.fast_cases("gemma4")
def test_outputs_are_varied_and_depend_on_the_whole_context(case):
    check_varied_and_context(case, "the global layer")


@pytest.mark.parametrize("block_size", [4, pytest.param(16, marks=pytest.mark.slow)])
@pytest.mark.fast_cases("gemma4-4")
def test_greedy_one_at_a_time_all_together_and_cache_hot(case, block_size):
    check_greedy_alone_together_and_hot(case, block_size)


@pytest.mark.slow
def test_chunked_prefill_ending_off_block_boundaries(case):
    check_chunked_prefill(case)


@pytest.mark.slow
def test_preemption_in_a_small_pool(case):
    check_preemption(case)


@pytest.mark.fast_cases("gemma4")
def test_top20_logprobs_within_1e_4(case):
    check_top20_logprobs(case)


@pytest.mark.slow  # loads a model of its own
def test_vision_tower_skipped_and_each_layer_keeps_k_and_v_of_its_shape(gemma4_dirs, caplog):
    """One log line for the vision tower; each layer's pages have its shape: the window layers 2 KV heads of 16 in
    the window group's pages, the global layer 1 head of 32, K and V both (the keys are normed and rotated, the
    values not)."""
    with caplog.at_level(logging.INFO, logger="engine.weights"):
        llm = new_llm(gemma4_dirs["gemma4"], block_size=4, num_kv_blocks=64, num_window_blocks=40)
    assert sum("vision tower" in r.message for r in caplog.records) == 1
    assert not any("vision" in name for name, _ in llm.engine.runner.model.named_parameters())
    caches = llm.engine.runner.kv_caches
    assert [tuple(t.shape) for t in caches[0]] == [(40, 4, 2, 16)] * 2
    assert [tuple(t.shape) for t in caches[5]] == [(64, 4, 1, 32)] * 2
    spec = llm.engine.runner.kv_spec
    assert spec.window_bytes_per_block(4, torch.float32) == 5 * 2 * 4 * 2 * 16 * 4
    assert spec.bytes_per_block(4, torch.float32) == spec.window_bytes_per_block(4, torch.float32) + 2 * 4 * 32 * 4


@pytest.mark.parametrize("key, value, message", [
    ("use_bidirectional_attention", True, "bidirectional"),  # per-layer inputs (E2B / E4B) are served since 7da7aa5
    ("num_kv_shared_layers", 2, "shared"),
])
def test_what_is_refused(key, value, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(dict(_TEXT, model_type="gemma4_text", **{key: value}))


@pytest.mark.slow
@pytest.mark.parametrize("case", ["gemma4"], indirect=True)
def test_tensor_parallel_2(case):
    """Two gloo ranks on CPU: each holds half the query heads of every layer, the window layers' KV heads split, the
    global layer's one KV head on both, half the MLPs and half the vocabulary."""
    check_tensor_parallel(case)


def test_the_engines_pages_of_gemma_4_31b_are_the_documented_bytes_per_token():
    """Gemma-4-31B's text config (60 layers, window 1024, 16 KV heads of 256 in the window layers, 4 of 512 with K = V
    projection in the global ones) built on the meta device: its cache spec keeps what docs/SLIDING_WINDOW.md prices
    (`benchmarks.prefix.policies.sliding_window.SHAPES`), K and V both in the global layers."""
    from benchmarks.prefix.policies.sliding_window import SHAPES
    from engine.models.architectures import MODEL_CLASSES

    text = dict(model_type="gemma4_text", vocab_size=262144, hidden_size=5376, intermediate_size=21504,
                num_hidden_layers=60, num_attention_heads=32, num_key_value_heads=16, head_dim=256,
                global_head_dim=512, num_global_key_value_heads=4, attention_k_eq_v=True, sliding_window=1024,
                hidden_size_per_layer_input=0)
    cfg = ModelConfig.from_dict({"model_type": "gemma4", "text_config": text, "vision_config": {}})
    with torch.device("meta"):
        spec = MODEL_CLASSES[cfg.architecture](cfg, ops=None).kv_cache_spec()
    shape = SHAPES["Gemma-4-31B"]
    assert (spec.window, spec.num_window_layers) == (shape.window, shape.window_layers)
    assert spec.bytes_per_token(torch.bfloat16) == shape.dense_bytes_per_token == 880 * 1024
    assert spec.window_bytes_per_block(1, torch.bfloat16) == shape.window_bytes_per_token


@pytest.mark.slow
def test_registry_gemma4_tiny_matches_transformers():
    """The registry's gemma4-tiny (Gemma4ForCausalLM's layout as Gemma-4-31B's shape: K = V projection and one wide
    KV head in the global layer, a 16-token window; random weights, Gemma 3's real tokenizer): greedy tokens of
    varied continuations equal transformers' in steps that mix chunked prefills with decodes."""
    cfg = check_registry_model("gemma4-tiny", 262_144).engine.model_cfg
    assert cfg.gemma4.k_eq_v and cfg.gemma4.head_dims[-1] == 64 and cfg.vocab_size == 262_144
