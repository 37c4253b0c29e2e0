"""GGUF (llama.cpp) Llama or Gemma 3 checkpoint -> Hugging Face directory with fp32 safetensors and a tokenizer.json.

Three things differ from a plain rename: quantized tensors are dequantized with the `gguf` package; llama.cpp's
converter permutes the rows of a Llama's q_proj/k_proj (it pairs rotary dimensions as (i, i+1), HF Llama as
(i, i+d/2)), which must be undone, and stores Gemma's (1 + w) norm weights with the 1 added; and the tokenizer lives
in GGUF metadata (token strings, merges or scores, token types) rather than in files. A byte-level BPE (Llama 3,
SmolLM) is rebuilt here; a SentencePiece one (Gemma) is converted by transformers' GGUF tokenizer integration, which
rebuilds the merges a Gemma file leaves out from the order of its vocabulary.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file
from tqdm import tqdm

from .hf_layout import DecoderDims, TokenizerInfo, added_token, byte_level_bpe_tokenizer, write_json, write_model_configs

_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Gemma 3: q/k norms, and the sandwich norms around attention and MLP (llama.cpp's ffn_norm is the pre-MLP norm)
_GEMMA3_LAYER_TENSORS = {
    **{k: v for k, v in _LAYER_TENSORS.items() if k != "ffn_norm.weight"},
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(.+)")

# tokenizer.ggml.pre -> the HF pre-tokenizer llama.cpp's pre-tokenizer type stands for.
_GPT2_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
_PRE_TOKENIZERS: dict[str, dict[str, Any]] = {
    "gpt-2": _GPT2_BYTE_LEVEL,
    # SmolLM: every digit on its own, then GPT-2's regex.
    "smollm": {
        "type": "Sequence",
        "pretokenizers": [{"type": "Digits", "individual_digits": True}, _GPT2_BYTE_LEVEL],
    },
}
_CONTROL, _USER_DEFINED = 3, 4  # gguf.TokenType values of added tokens


@dataclass(frozen=True)
class GGUFMetadata:
    fields: dict[str, Any]

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.fields:
            raise ValueError(f"GGUF metadata lacks {key!r}")
        return self.fields[key]


def read_metadata(reader: Any) -> GGUFMetadata:
    return GGUFMetadata({name: field.contents() for name, field in reader.fields.items()})


def hf_tensor_name(gguf_name: str, layer_tensors: dict[str, str] = _LAYER_TENSORS) -> str:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _LAYER_NAME.fullmatch(gguf_name)
    if match is None or match.group(2) not in layer_tensors:
        raise ValueError(f"unsupported GGUF tensor {gguf_name!r}")
    return f"model.layers.{match.group(1)}.{layer_tensors[match.group(2)]}"


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's q/k permutation: per head, rows (pair index, 2) -> (2, pair index)."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _dequantize(tensor: Any) -> torch.Tensor:
    from gguf.quants import dequantize

    values = dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dimensions innermost first
    return torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))  # a copy: GGUF data is a read-only map


def _decimal(value: float) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


def llama_dims(meta: GGUFMetadata, has_output_weight: bool, num_tokens: int) -> DecoderDims:
    arch = meta.require("general.architecture")
    if arch != "llama":
        raise ValueError(f"only GGUF architecture 'llama' is supported, not {arch!r}")
    if meta.get("llama.rope.scaling.type", "none") != "none":
        raise ValueError("GGUF files with RoPE scaling are not supported")
    hidden = int(meta.require("llama.embedding_length"))
    heads = int(meta.require("llama.attention.head_count"))
    return DecoderDims(
        vocab_size=int(meta.get("llama.vocab_size", num_tokens)),
        hidden_size=hidden,
        intermediate_size=int(meta.require("llama.feed_forward_length")),
        num_hidden_layers=int(meta.require("llama.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(meta.get("llama.attention.head_count_kv", heads)),
        head_dim=int(meta.get("llama.rope.dimension_count", hidden // heads)),
        max_position_embeddings=int(meta.require("llama.context_length")),
        rope_theta=_decimal(meta.get("llama.rope.freq_base", 10000.0)),
        rms_norm_eps=_decimal(meta.require("llama.attention.layer_norm_rms_epsilon")),
        tie_word_embeddings=not has_output_weight,
    )


# llama.cpp's Gemma 3 constants, which its GGUF files do not carry: every sixth layer is global, the local layers' RoPE
# base is 10k, and the softmax scale is head_dim ** -0.5 except for the 27B (hidden / heads = 168: 62 layers)
GEMMA3_SLIDING_WINDOW_PATTERN = 6
GEMMA3_LOCAL_ROPE_THETA = 10_000.0
_GEMMA3_27B_LAYERS = 62


def gemma3_config(meta: GGUFMetadata, has_output_weight: bool, num_tokens: int) -> tuple[DecoderDims, dict[str, Any]]:
    """Gemma 3's shape (`DecoderDims`) and the rest of its config.json (window, layer types, local RoPE, ...)."""
    hidden = int(meta.require("gemma3.embedding_length"))
    heads = int(meta.require("gemma3.attention.head_count"))
    head_dim = int(meta.require("gemma3.attention.key_length"))
    layers = int(meta.require("gemma3.block_count"))
    dims = DecoderDims(
        vocab_size=int(meta.get("gemma3.vocab_size", num_tokens)),
        hidden_size=hidden,
        intermediate_size=int(meta.require("gemma3.feed_forward_length")),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=int(meta.get("gemma3.attention.head_count_kv", heads)),
        head_dim=head_dim,
        max_position_embeddings=int(meta.require("gemma3.context_length")),
        rope_theta=_decimal(meta.get("gemma3.rope.freq_base", 1_000_000.0)),
        rms_norm_eps=_decimal(meta.require("gemma3.attention.layer_norm_rms_epsilon")),
        tie_word_embeddings=not has_output_weight,
    )
    scaling = meta.get("gemma3.rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise ValueError(f"Gemma 3 GGUF files with RoPE scaling {scaling!r} are not supported (linear is)")
    extra: dict[str, Any] = {
        "sliding_window": int(meta.require("gemma3.attention.sliding_window")),
        "layer_types": ["full_attention" if (i + 1) % GEMMA3_SLIDING_WINDOW_PATTERN == 0 else "sliding_attention"
                        for i in range(layers)],
        "rope_local_base_freq": GEMMA3_LOCAL_ROPE_THETA,
        "query_pre_attn_scalar": hidden // heads if layers == _GEMMA3_27B_LAYERS else head_dim,
    }
    if scaling == "linear":
        extra["rope_scaling"] = {"rope_type": "linear", "factor": _decimal(meta.require("gemma3.rope.scaling.factor"))}
    return dims, extra


def sentencepiece_tokenizer(gguf_path: Path, meta: GGUFMetadata, out_dir: Path) -> TokenizerInfo:
    """tokenizer.json and tokenizer_config.json in ``out_dir`` for a SentencePiece vocabulary (Gemma's), converted by
    transformers' GGUF integration; returns the ids config.json needs. Gemma's turns end with ``<end_of_turn>``,
    which generation stops at as the released generation_config.json does."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(str(out_dir))
    tokens: list[str] = list(meta.require("tokenizer.ggml.tokens"))
    eos = [int(meta.require("tokenizer.ggml.eos_token_id"))]
    if "<end_of_turn>" in tokens and meta.get("general.architecture") == "gemma3":
        eos.append(tokens.index("<end_of_turn>"))
    pad = meta.get("tokenizer.ggml.padding_token_id")
    bos = meta.get("tokenizer.ggml.bos_token_id")
    return TokenizerInfo(num_tokens=len(tokens), bos_token_id=None if bos is None else int(bos),
                         eos_token_ids=tuple(eos), pad_token_id=None if pad is None else int(pad))


def tokenizer_files(meta: GGUFMetadata) -> tuple[dict[str, Any], dict[str, Any], TokenizerInfo]:
    """tokenizer.json, tokenizer_config.json and token ids from a GPT-2-style byte-level BPE in GGUF metadata."""
    kind = meta.require("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"only byte-level BPE ('gpt2') GGUF tokenizers are supported, not {kind!r}")
    pre = meta.get("tokenizer.ggml.pre", "gpt-2")
    if pre not in _PRE_TOKENIZERS:
        raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r}; supported: {sorted(_PRE_TOKENIZERS)}")
    tokens: list[str] = list(meta.require("tokenizer.ggml.tokens"))
    types: list[int] = list(meta.require("tokenizer.ggml.token_type"))
    added = [
        added_token(i, token, special=kind == _CONTROL)
        for i, (token, kind) in enumerate(zip(tokens, types))
        if kind in (_CONTROL, _USER_DEFINED)
    ]
    tokenizer = byte_level_bpe_tokenizer(
        added,
        normalizer=None,
        pre_tokenizer=_PRE_TOKENIZERS[pre],
        post_processor={"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        decoder={"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        vocab={token: i for i, token in enumerate(tokens)},
        merges=[merge.split(" ") for merge in meta.require("tokenizer.ggml.merges")],
        ignore_merges=False,
    )

    def optional_id(key: str) -> int | None:
        return None if meta.get(key) is None else int(meta.get(key))

    def token_at(key: str) -> str | None:
        token_id = optional_id(key)
        return None if token_id is None else tokens[token_id]

    info = TokenizerInfo(
        num_tokens=len(tokens),
        bos_token_id=optional_id("tokenizer.ggml.bos_token_id"),
        eos_token_ids=(int(meta.require("tokenizer.ggml.eos_token_id")),),
        pad_token_id=optional_id("tokenizer.ggml.padding_token_id"),
    )
    config: dict[str, Any] = {
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(t["id"]): {k: t[k] for k in ("content", "lstrip", "normalized", "rstrip", "single_word", "special")}
            for t in added
        },
        "additional_special_tokens": [t["content"] for t in added if t["special"]],
        "bos_token": token_at("tokenizer.ggml.bos_token_id"),
        "clean_up_tokenization_spaces": False,
        "eos_token": token_at("tokenizer.ggml.eos_token_id"),
        "model_max_length": int(meta.get("llama.context_length", 2048)),
        "pad_token": token_at("tokenizer.ggml.padding_token_id"),
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": token_at("tokenizer.ggml.unknown_token_id"),
    }
    template = meta.get("tokenizer.chat_template")
    if template is not None:
        config["chat_template"] = template
    return tokenizer, config, info


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write an HF directory (configs, tokenizer, fp32 model.safetensors) for the GGUF file into `out_dir`: a Llama
    (``general.architecture`` llama) or a Gemma 3 text model (gemma3, written as Gemma3ForCausalLM's gemma3_text)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    meta = read_metadata(reader)
    arch = meta.require("general.architecture")
    if arch not in ("llama", "gemma3"):
        raise ValueError(f"only GGUF architectures 'llama' and 'gemma3' are supported, not {arch!r}")
    if meta.require("tokenizer.ggml.model") == "llama":  # SentencePiece
        tokens = sentencepiece_tokenizer(gguf_path, meta, out_dir)
    else:
        tokenizer, tokenizer_config, tokens = tokenizer_files(meta)
        (out_dir / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False), encoding="utf-8")
        write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    names = {t.name for t in reader.tensors}
    has_output = "output.weight" in names
    if arch == "gemma3":
        dims, extra = gemma3_config(meta, has_output, tokens.num_tokens)
    else:
        dims, extra = llama_dims(meta, has_output_weight=has_output, num_tokens=tokens.num_tokens), None

    tensors: dict[str, torch.Tensor] = {}
    for tensor in tqdm(reader.tensors, desc=f"dequantizing {gguf_path.name}", disable=None):
        weight = _dequantize(tensor)
        if arch == "gemma3":
            if tensor.name.endswith("norm.weight"):  # llama.cpp stores Gemma's (1 + w) gains as 1 + w
                weight = weight - 1.0
            tensors[hf_tensor_name(tensor.name, _GEMMA3_LAYER_TENSORS)] = weight.contiguous()
            continue
        if tensor.name.endswith("attn_q.weight"):
            weight = unpermute_rotary_rows(weight, dims.num_attention_heads)
        elif tensor.name.endswith("attn_k.weight"):
            weight = unpermute_rotary_rows(weight, dims.num_key_value_heads)
        tensors[hf_tensor_name(tensor.name)] = weight.contiguous()

    write_model_configs(out_dir, "gemma3_text" if arch == "gemma3" else "llama", dims, tokens, extra)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
