"""Gemma 4 E2B / E4B's layout: per-layer embeddings (PLE) and shared KV layers, on ``gemma4-e2b-tiny`` (the
registry's random weights in Gemma4ForCausalLM's layout) and on a tiny Gemma4ForConditionalGeneration in the released
names beside vision and audio towers, as E2B is released.

Six layers, window 16: [window, window, global, window, window, global]; the last three are shared (layers 3 and 4
read layer 1's window pages, layer 5 layer 2's global pages) and keep none of their own, their MLPs twice as wide.
Greedy tokens equal transformers' one prompt at a time, all together, cache hot (blocks of 4 and 16), with chunked
prefills ending off block boundaries, under preemption and over two tensor-parallel ranks; top-20 logprobs within 1e-4
in fp32; prompts up to 70 tokens, past the window.
"""
from __future__ import annotations

import copy
import logging
import shutil
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import ModelConfig
from engine.registry import resolve_model
from tests.hf_oracle import (
    TOKENIZER_FILES, CheckpointDirs, assert_greedy_alone_and_together, assert_greedy_cache_hot,
    assert_greedy_through_preemption, assert_top_logprobs_equal_hf, assert_varied, hf_greedy, hf_model, logit_shift,
    random_prompts,
)

MODEL = "gemma4-e2b-tiny"
VOCAB = 262144  # Gemma 3's tokenizer's (Gemma 4 keeps its vocabulary)
LENGTHS = [1, 4, 9, 17, 40, 70]
NEW_TOKENS = 8
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def case():
    prompts = random_prompts(VOCAB, LENGTHS, seed=3)
    return MODEL, prompts, [hf_greedy(MODEL, p, NEW_TOKENS) for p in prompts]


@pytest.mark.parametrize("layers, shared, window_every", [(6, 3, 3), (35, 20, 5), (42, 18, 6)], ids=["tiny", "e2b", "e4b"])
def test_the_config_reads_per_layer_inputs_and_the_layers_kv_sources_as_transformers(layers, shared, window_every):
    """Each shared layer reads the last layer of its kind before the shared ones, where transformers'
    ``kv_sharing_modes`` stores K / V ("store") for the layers that "reuse" them: gemma4-e2b-tiny's layout, E2B's and
    E4B's (a global layer every 3rd, 5th, 6th)."""
    from transformers import Gemma4TextConfig

    kinds = ["full_attention" if (i + 1) % window_every == 0 else "sliding_attention" for i in range(layers)]
    hf = Gemma4TextConfig(num_hidden_layers=layers, layer_types=kinds, num_kv_shared_layers=shared,
                          hidden_size_per_layer_input=16, vocab_size_per_layer_input=VOCAB, use_double_wide_mlp=True)
    stored = {kinds[i]: i for i, mode in enumerate(hf.kv_sharing_modes) if mode == "store"}
    expected = tuple(stored[kinds[i]] if mode == "reuse" else i for i, mode in enumerate(hf.kv_sharing_modes))
    cfg = ModelConfig.from_dict(dict(hf.to_dict(), model_type="gemma4_text")).gemma4
    assert cfg.kv_sources == expected and cfg.num_kv_layers == layers - shared and cfg.double_wide_mlp
    # the global layers' head size, from transformers' per_layer_config (keyed "04", "09", ... past 9 layers)
    assert cfg.head_dims == tuple(512 if kind == "full_attention" else 256 for kind in kinds)
    assert (cfg.per_layer_inputs.size, cfg.per_layer_inputs.vocab_size) == (16, VOCAB)
    if layers == 6:
        assert expected == (0, 1, 2, 1, 1, 2)


@pytest.mark.slow  # transformers' model twice
def test_outputs_are_varied_and_depend_on_the_context_and_the_per_layer_inputs(case):
    """Different prompts continue differently; a token far outside the window still moves the next token's logits
    (through the global layers, shared ones included), and the per-layer inputs move them a lot: parity with them
    proves they are applied."""
    name, prompts, expected = case
    assert_varied(expected, 5)
    assert logit_shift(name, prompts[-1], 3) > 0.5, "a token inside the window moves the logits"
    assert logit_shift(name, prompts[-1], 69) > 0.05, "so does the first one, through the global layers"
    without = copy.deepcopy(hf_model(name))
    with torch.no_grad():
        for layer in without.model.layers:
            layer.per_layer_projection.weight.zero_()
        ids = torch.tensor([prompts[-1]])
        shift = (hf_model(name)(ids).logits[0, -1] - without(ids).logits[0, -1]).abs().max()
    assert shift > 0.5, "the per-layer inputs change the logits"


@pytest.mark.slow
@pytest.mark.parametrize("block_size", [4, 16])
def test_greedy_one_at_a_time_all_together_and_cache_hot(case, block_size):
    """Cache hot: every prompt's full blocks come from the prefix cache, the window layers' pages included, and the
    shared layers read them as the source layers left them. Then a conversation's next turn (the longest prompt +
    its reply + new tokens, past the window) reads all but the last block of the previous turn from the cache and
    continues as transformers does."""
    name, prompts, expected = case
    llm = LLM(name, block_size=block_size, num_kv_blocks=512)
    assert_greedy_alone_and_together(llm, prompts, expected)
    assert_greedy_cache_hot(llm, prompts, expected, block_size)
    turn = prompts[-1] + expected[-1] + prompts[3]
    out = llm.generate([turn], GREEDY)[0]
    assert out.token_ids == hf_greedy(name, turn, NEW_TOKENS)
    assert out.num_cached_tokens >= (len(prompts[-1]) + NEW_TOKENS - 1) // block_size * block_size - block_size


@pytest.mark.slow
def test_chunked_prefill_ending_off_block_boundaries(case):
    """A 7-token budget with 4-token blocks: chunks end mid-block and mid-window, decodes and chunks share steps; a
    shared layer reads the chunk's K / V its source layer has just stored. The shared layers run on the sampled
    rows alone (none for a chunk mid-prompt), as transformers' prefill does: one row per token generated."""
    name, prompts, expected = case
    llm = LLM(name, block_size=4, num_kv_blocks=512, max_num_batched_tokens=7)
    rows = {2: [], 3: []}  # the last unshared layer's and the first shared one's rows per step
    model = llm.engine.runner.model
    for i, seen in rows.items():
        model.layers[i].mixer.register_forward_pre_hook(lambda _, args, seen=seen: seen.append(len(args[1])))
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
    assert sum(rows[2]) == sum(LENGTHS) + len(prompts) * (NEW_TOKENS - 1)
    assert sum(rows[3]) == len(prompts) * NEW_TOKENS


@pytest.mark.slow
def test_preemption_in_a_small_pool_where_shared_layers_keep_no_pages(case):
    """Three of the six layers keep pages: the two window layers in the window group's pages (one KV head of 32),
    the global layer one of 64, K and V each; the shared layers' attention reads those tensors themselves. 32 blocks
    do not hold every prompt at once: preempted sequences are recomputed and still give transformers' tokens."""
    name, prompts, expected = case
    llm = LLM(name, block_size=4, num_kv_blocks=32, num_window_blocks=40, max_num_batched_tokens=32)
    runner = llm.engine.runner
    assert [tuple(t.shape) for layer in runner.kv_caches for t in layer] == [(40, 4, 1, 32)] * 4 + [(32, 4, 1, 64)] * 2
    spec = runner.kv_spec
    assert spec.num_layers == 3 and spec.layer_windows == (16, 16, None)
    assert spec.bytes_per_block(4, torch.float32) == 2 * 4 * (2 * 32 + 64) * 4
    caches = runner.model.layer_caches(runner.kv_caches)
    assert [caches[i] is runner.kv_caches[j] for i, j in ((3, 1), (4, 1), (5, 2))] == [True] * 3
    assert not any(name.startswith("layers.3.self_attn.k") for name, _ in runner.model.named_parameters())
    assert_greedy_through_preemption(llm, prompts, expected)


@pytest.mark.slow
def test_triton_kernels_chunked(case):
    """The Triton op set (under the interpreter on CPU, so one prompt of 40 tokens in two chunks, past the window,
    and three tokens): the shared layers rotate their queries alone and attend over their source layer's window and
    global pages."""
    name, prompts, expected = case
    llm = LLM(name, attention_backend="triton", block_size=4, num_kv_blocks=512, max_num_batched_tokens=24)
    out = llm.generate([prompts[4]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    assert out.token_ids == expected[4][:3]


@pytest.mark.slow
def test_top20_logprobs_within_1e_4(case):
    name, prompts, _ = case
    llm = LLM(name, block_size=4, num_kv_blocks=512, max_num_batched_tokens=32)
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0, logprobs=20))
    for prompt, out in zip(prompts, outs):
        assert_top_logprobs_equal_hf(name, prompt, out.outputs[0].logprobs[0].top, atol=1e-4)


@pytest.mark.slow
def test_tensor_parallel_2(case):
    """Two gloo ranks: each holds half the query heads, the one KV head on both, half the MLPs, half the vocabulary
    of the embedding and of the per-layer table (its lookups summed over the ranks); the per-layer projection and
    gates on both."""
    name, prompts, expected = case
    with LLM(name, block_size=4, num_kv_blocks=256, max_num_batched_tokens=16, tensor_parallel_size=2) as llm:
        outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == expected


# E2B's released layout: the language model under model.language_model.* beside vision and audio towers
_QWEN_VOCAB = 151936  # the Qwen3 tokenizer's, which the checkpoint below carries
_TEXT = dict(vocab_size=_QWEN_VOCAB, vocab_size_per_layer_input=_QWEN_VOCAB, hidden_size=64, intermediate_size=64,
             num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=1, head_dim=16, global_head_dim=32,
             layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2, sliding_window=8,
             hidden_size_per_layer_input=8, num_kv_shared_layers=3, use_double_wide_mlp=True,
             final_logit_softcapping=30.0, max_position_embeddings=4096, eos_token_id=151645, pad_token_id=0,
             bos_token_id=151643)
_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
               head_dim=16, patch_size=8, position_embedding_size=64)
_AUDIO = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, subsampling_conv_channels=[8, 4],
              output_proj_dims=32, use_clipped_linears=False)  # (the clips are scalars, which tiny.py does not draw)


def _write_released_layout(kind: str, out: Path) -> None:
    """Gemma4ForConditionalGeneration's config by save_pretrained, its tensors in the released names with the tiny
    models' weight scales (engine/model_sources/tiny.py), the Qwen3 tokenizer's files beside them."""
    import transformers as tf

    from engine.model_sources.tiny import write_random_weights

    tf.Gemma4Config(text_config=tf.Gemma4TextConfig(**_TEXT), vision_config=tf.Gemma4VisionConfig(**_VISION),
                    audio_config=tf.Gemma4AudioConfig(**_AUDIO)).save_pretrained(out)
    write_random_weights(out, seed=31)
    for name in TOKENIZER_FILES:
        shutil.copyfile(resolve_model("qwen3-tiny") / name, out / name)


@pytest.mark.slow  # writes and loads a checkpoint of its own
def test_the_released_layout_skips_its_towers_and_equals_transformers(tmp_path, caplog):
    """One log line for each tower left on disk (vision, audio); the language model's greedy tokens are
    transformers' for prompts past the window, cache hot and in chunks."""
    path = CheckpointDirs(tmp_path, _write_released_layout)["e2b"]
    prompts = random_prompts(_QWEN_VOCAB, [9, 40], seed=5)
    expected = [hf_greedy(path, p, NEW_TOKENS) for p in prompts]
    with caplog.at_level(logging.INFO, logger="engine.weights"):
        llm = LLM(path, block_size=4, num_kv_blocks=256, max_num_batched_tokens=7, language_model_only=True)
    assert [sum(tower in r.message for r in caplog.records) for tower in ("vision tower", "audio tower")] == [1, 1]
    assert_greedy_alone_and_together(llm, prompts, expected)
    assert_greedy_cache_hot(llm, prompts, expected, 4)


def test_the_engines_pages_of_e2b_and_e4b_are_the_documented_bytes_per_token():
    """E2B and E4B's text configs built on the meta device: the cache spec keeps the unshared layers alone, in bf16
    18 KiB and 56 KiB a token against 42 KiB and 98 KiB with every layer keeping its own (docs/MODELS.md), what
    docs/SLIDING_WINDOW.md prices (`benchmarks.prefix.policies.sliding_window.SHAPES`)."""
    from benchmarks.prefix.policies.sliding_window import SHAPES
    from engine.models.architectures import MODEL_CLASSES

    pattern = {"e2b": ["sliding_attention"] * 4 + ["full_attention"], "e4b": ["sliding_attention"] * 5 + ["full_attention"]}
    shapes = {"e2b": dict(hidden_size=1536, intermediate_size=6144, num_hidden_layers=35, num_key_value_heads=1,
                          num_kv_shared_layers=20, use_double_wide_mlp=True),
              "e4b": dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=42, num_key_value_heads=2,
                          num_kv_shared_layers=18, use_double_wide_mlp=False)}
    for model, (shared, unshared) in {"e2b": (18_432, 43_008), "e4b": (57_344, 100_352)}.items():
        text = dict(model_type="gemma4_text", vocab_size=262144, num_attention_heads=8, head_dim=256,
                    global_head_dim=512, sliding_window=512, hidden_size_per_layer_input=256,
                    vocab_size_per_layer_input=262144, layer_types=pattern[model] * 7, **shapes[model])
        cfg = ModelConfig.from_dict({"model_type": "gemma4", "text_config": text, "vision_config": {}})
        with torch.device("meta"):
            spec = MODEL_CLASSES[cfg.architecture](cfg, ops=None).kv_cache_spec()
            every = MODEL_CLASSES[cfg.architecture](
                ModelConfig.from_dict(dict(text, num_kv_shared_layers=0)), ops=None).kv_cache_spec()
        assert (spec.bytes_per_token(torch.bfloat16), every.bytes_per_token(torch.bfloat16)) == (shared, unshared)
        assert SHAPES[f"Gemma-4-{model.upper()}"].dense_bytes_per_token == shared
