"""The files of a standard Hugging Face model directory, written the way real checkpoints write them.

config.json is written as a plain dict in the classic layout of published checkpoints (top-level `rope_theta`,
`rope_scaling: null`, ...) rather than through a transformers `PretrainedConfig`, whose serialised form changes between
transformers versions: consumers of these directories must read real checkpoints anyway.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_DEEPSEEK_V3_ROUTING = {
    "attention_bias": False, "scoring_func": "sigmoid", "topk_method": "noaux_tc", "norm_topk_prob": True,
    "moe_layer_freq": 1, "n_shared_experts": 1, "num_nextn_predict_layers": 0, "ep_size": 1, "aux_loss_alpha": 0.001,
    "seq_aux": True, "pretraining_tp": 1,
}

# model_type -> (architectures entry, keys that only this family's config.json carries)
_FAMILY_KEYS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaForCausalLM", {"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1}),
    "qwen2": (
        "Qwen2ForCausalLM",
        {"use_sliding_window": False, "sliding_window": None, "max_window_layers": 0, "use_mrope": False},
    ),
    "qwen3": (
        "Qwen3ForCausalLM",
        {"attention_bias": False, "use_sliding_window": False, "sliding_window": None, "max_window_layers": 0},
    ),
    # The MoE and MLA sizes come with the recipe's `config`; these are the routing defaults of the real checkpoints.
    "qwen3_moe": (
        "Qwen3MoeForCausalLM",
        {"attention_bias": False, "use_sliding_window": False, "sliding_window": None, "max_window_layers": 0,
         "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True, "output_router_logits": False,
         "router_aux_loss_coef": 0.001},
    ),
    "deepseek_v3": ("DeepseekV3ForCausalLM", _DEEPSEEK_V3_ROUTING),
    "deepseek_v32": ("DeepseekV32ForCausalLM", _DEEPSEEK_V3_ROUTING),  # + the indexer's sizes, from the recipe
    # GLM-5 (zai-org/GLM-5's config.json): V3.2's routing with one expert group; the indexer's sizes and schedule
    # (indexer_types) come with the recipe
    "glm_moe_dsa": ("GlmMoeDsaForCausalLM", {**_DEEPSEEK_V3_ROUTING, "n_group": 1, "topk_group": 1}),
    # GLM-4.7-Flash (zai-org/GLM-4.7-Flash's config.json): DeepSeek-V3's routing with one expert group, full RoPE
    "glm4_moe_lite": ("Glm4MoeLiteForCausalLM", {
        **_DEEPSEEK_V3_ROUTING, "n_group": 1, "topk_group": 1, "partial_rotary_factor": 1.0, "rope_interleave": True}),
    # V4's attention and routing schedules (layer_types, mlp_layer_types, compress_rates, ...) come with the recipe
    "deepseek_v4": ("DeepseekV4ForCausalLM", {"attention_bias": False, "scoring_func": "sqrtsoftplus",
                                              "norm_topk_prob": True, "num_nextn_predict_layers": 0}),
    # Qwen3.5 / 3.6's language model alone (what Qwen3_5ForCausalLM saves); the linear-attention sizes come with
    # the recipe's `config`
    "qwen3_5_text": ("Qwen3_5ForCausalLM", {"attention_bias": False, "full_attention_interval": 4,
                                            "linear_conv_kernel_dim": 4, "partial_rotary_factor": 0.25}),
    "qwen3_5_moe_text": ("Qwen3_5MoeForCausalLM", {"attention_bias": False, "full_attention_interval": 4,
                                                   "linear_conv_kernel_dim": 4, "partial_rotary_factor": 0.25}),
    # Gemma 3's language model alone (the 270M / 1B checkpoints); the window, layer types and local RoPE base come
    # with the recipe's `config` (or the GGUF converter)
    "gemma3_text": ("Gemma3ForCausalLM", {"attention_bias": False, "hidden_act": "gelu_pytorch_tanh",
                                          "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": None,
                                          "attn_logit_softcapping": None, "use_bidirectional_attention": False}),
    # Gemma 4's language model alone (Gemma4ForCausalLM); the window, layer types, RoPE per layer type and the global
    # layers' shape (global_head_dim, num_global_key_value_heads, attention_k_eq_v) come with the recipe's `config`
    # Muse-Glimmer's language model (inside MuseGlimmerForConditionalGeneration's text_config: the only released
    # layout); the window, layer types, RoPE and its scalars come with the recipe's `config`
    "muse_glimmer_text": ("MuseGlimmerTextModel", {"attention_bias": False, "hidden_activation": "silu"}),
    "gemma4_text": ("Gemma4ForCausalLM", {"attention_bias": False, "hidden_activation": "gelu_pytorch_tanh",
                                          "hidden_size_per_layer_input": 0, "num_kv_shared_layers": 0,
                                          "enable_moe_block": False, "use_bidirectional_attention": None}),
    # gpt-oss (openai/gpt-oss-20b's config.json); its window, layer types, experts, YaRN and MXFP4
    # quantization_config come with the recipe's `config`
    # Ministral 3 / Devstral Small 2's language model alone (Ministral3ForCausalLM); YaRN with Llama 4's query
    # temperature comes with the recipe's `config` (`rope_parameters`)
    "ministral3": ("Ministral3ForCausalLM", {"sliding_window": None, "pad_token_id": 11}),
    # MiniMax-M2 / M2.5 (MiniMaxAI/MiniMax-M2's config.json): q/k norms across heads, sigmoid routing with a bias;
    # rotary_dim and the expert counts come with the recipe
    "minimax_m2": ("MiniMaxM2ForCausalLM", {"use_qk_norm": True, "qk_norm_type": "per_layer", "scoring_func": "sigmoid",
                                            "use_routing_bias": True, "output_router_logits": False,
                                            "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0}),
    # Kimi Linear (moonshotai/Kimi-Linear-48B-A3B-Instruct's config.json): a dense first layer, then DeepSeek-V3's
    # sigmoid routing (one group) with a shared expert, MLA without RoPE; linear_attn_config (which layers are KDA,
    # 1-indexed), the MLA and expert sizes come with the recipe
    "kimi_linear": ("KimiLinearForCausalLM", {"first_k_dense_replace": 1, "moe_layer_freq": 1, "moe_renormalize": True,
                                              "moe_router_activation_func": "sigmoid", "num_expert_group": 1,
                                              "topk_group": 1, "use_grouped_topk": True, "mla_use_nope": True,
                                              "num_nextn_predict_layers": 0, "q_lora_rank": None}),
    "gpt_oss": ("GptOssForCausalLM", {"attention_bias": True, "hidden_act": "silu", "swiglu_limit": 7.0,
                                      "initializer_range": 0.02, "output_router_logits": False,
                                      "router_aux_loss_coef": 0.9}),
}
SUPPORTED_MODEL_TYPES = tuple(_FAMILY_KEYS)
# Configs whose RoPE is in rope_parameters alone (Gemma 4's keyed by layer type): transformers reads a top-level
# rope_scaling, even a null one, over rope_parameters
_ROPE_BY_LAYER_TYPE = ("gemma4_text", "muse_glimmer_text")


@dataclass(frozen=True)
class DecoderDims:
    """The numbers that define a Llama-family decoder."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool


@dataclass(frozen=True)
class TokenizerInfo:
    """Token ids a model's config.json and generation_config.json must agree with."""

    num_tokens: int  # highest token id + 1
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]  # the first is the tokenizer's eos_token
    pad_token_id: int | None


def decoder_config(
    model_type: str, dims: DecoderDims, tokens: TokenizerInfo, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """config.json's keys; ``extra`` adds or overrides architecture keys (MoE and MLA sizes, ``rope_scaling``)."""
    if model_type not in _FAMILY_KEYS:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {SUPPORTED_MODEL_TYPES}")
    if dims.vocab_size < tokens.num_tokens:
        raise ValueError(f"vocab_size {dims.vocab_size} is smaller than the tokenizer's {tokens.num_tokens} tokens")
    architecture, family_keys = _FAMILY_KEYS[model_type]
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "attention_dropout": 0.0,
        "bos_token_id": tokens.bos_token_id,
        "eos_token_id": tokens.eos_token_ids[0],
        "hidden_act": "silu",
        "hidden_size": dims.hidden_size,
        "head_dim": dims.head_dim,
        "initializer_range": 0.02,
        "intermediate_size": dims.intermediate_size,
        "max_position_embeddings": dims.max_position_embeddings,
        "num_attention_heads": dims.num_attention_heads,
        "num_hidden_layers": dims.num_hidden_layers,
        "num_key_value_heads": dims.num_key_value_heads,
        "rms_norm_eps": dims.rms_norm_eps,
        "rope_scaling": None,
        "rope_theta": dims.rope_theta,
        "tie_word_embeddings": dims.tie_word_embeddings,
        "torch_dtype": "float32",
        "use_cache": True,
        "vocab_size": dims.vocab_size,
    }
    config.update(family_keys)
    config.update(extra or {})
    if model_type in _ROPE_BY_LAYER_TYPE:
        del config["rope_scaling"], config["rope_theta"]
    return dict(sorted(config.items()))


def generation_config(tokens: TokenizerInfo) -> dict[str, Any]:
    """Only the token ids: sampling defaults are recommendations for trained weights, not for converted or random
    ones."""
    eos: int | list[int] = tokens.eos_token_ids[0] if len(tokens.eos_token_ids) == 1 else list(tokens.eos_token_ids)
    config: dict[str, Any] = {"bos_token_id": tokens.bos_token_id, "eos_token_id": eos}
    if tokens.pad_token_id is not None:
        config["pad_token_id"] = tokens.pad_token_id
    return config


def added_token(token_id: int, content: str, special: bool) -> dict[str, Any]:
    """One ``added_tokens`` entry of a tokenizer.json: matched whole, never normalized or split."""
    return {"id": token_id, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": False, "special": special}


def byte_level_bpe_tokenizer(
    added: list[dict[str, Any]],
    normalizer: dict[str, Any] | None,
    pre_tokenizer: dict[str, Any],
    post_processor: dict[str, Any],
    decoder: dict[str, Any],
    vocab: dict[str, int],
    merges: list[list[str]],
    ignore_merges: bool,
) -> dict[str, Any]:
    """A `tokenizers` tokenizer.json for a GPT-2-style byte-level BPE."""
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post_processor,
        "decoder": decoder,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": ignore_merges,
            "vocab": vocab,
            "merges": merges,
        },
    }


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")


# A language model's model_type -> (the vision-language checkpoint it sits in: its model_type, its architecture)
VLM_LAYOUTS = {"qwen3_5_text": ("qwen3_5", "Qwen3_5ForConditionalGeneration"),
               "qwen3_5_moe_text": ("qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration"),
               "muse_glimmer_text": ("muse_glimmer", "MuseGlimmerForConditionalGeneration"),
               "gemma3_text": ("gemma3", "Gemma3ForConditionalGeneration"),
               "gemma4_text": ("gemma4", "Gemma4ForConditionalGeneration")}
# Gemma 3's image tokens (the soft token after the 262,144 pieces), as the released configs name them
GEMMA3_IMAGE_TOKENS = {"image_token_index": 262144, "boi_token_index": 255999, "eoi_token_index": 256000}
# Gemma 4's media tokens, as the released configs name them (ids of Gemma 3's vocabulary, renamed)
GEMMA4_MEDIA_TOKENS = {"image_token_id": 258880, "boi_token_id": 255999, "eoi_token_id": 258882,
                       "video_token_id": 258884, "audio_token_id": 258881, "boa_token_id": 256000,
                       "eoa_token_index": 258883}
# the keys of a Gemma 4 recipe's `vision:` that are its image processor's, not its tower's
_GEMMA4_PROCESSOR_KEYS = ("max_soft_tokens",)
# Qwen3.5 / 3.6's vision tokens, as the released configs name them
_QWEN_VISION_TOKENS = {"image_token_id": 248056, "video_token_id": 248057, "vision_start_token_id": 248053,
                       "vision_end_token_id": 248054}


def vlm_config(text: dict[str, Any], vision: dict[str, Any]) -> dict[str, Any]:
    """A released vision-language config.json (Qwen3.5 / 3.6): the language model's config as ``text_config``,
    the tower's sizes as ``vision_config`` (its output as wide as the language model), the vision tokens' ids."""
    model_type, architecture = VLM_LAYOUTS[text["model_type"]]
    if model_type == "gemma3":  # a SigLIP tower without its pooling head; the projector pools to mm_tokens_per_image
        tower = {k: v for k, v in vision.items() if k != "mm_tokens_per_image"}
        return {"architectures": [architecture], "model_type": model_type, "text_config": text,
                "vision_config": {"model_type": "siglip_vision_model", "hidden_act": "gelu_pytorch_tanh",
                                  "layer_norm_eps": 1e-6, "num_channels": 3, "vision_use_head": False, **tower},
                "mm_tokens_per_image": vision["mm_tokens_per_image"],
                "tie_word_embeddings": text["tie_word_embeddings"], **GEMMA3_IMAGE_TOKENS}
    if model_type == "gemma4":  # its tower's own keys (patches pooled to a soft-token count per image)
        tower = {k: v for k, v in vision.items() if k not in _GEMMA4_PROCESSOR_KEYS}
        return {"architectures": [architecture], "model_type": model_type, "text_config": text,
                "vision_config": {"model_type": "gemma4_vision", "hidden_activation": "gelu_pytorch_tanh", **tower},
                "audio_config": None, "tie_word_embeddings": text["tie_word_embeddings"], **GEMMA4_MEDIA_TOKENS}
    if model_type == "muse_glimmer":  # its tower's own keys; patches merged 2 x 2 (4x the tower's width) then projected
        return {"architectures": [architecture], "model_type": model_type, "text_config": text,
                "vision_config": {"model_type": "muse_glimmer_vision", **vision},
                "out_hidden_size": 4 * vision["hidden_size"], "projector_hidden_size": text["hidden_size"],
                "tie_word_embeddings": text["tie_word_embeddings"]}
    vision = {"model_type": model_type, "hidden_act": "gelu_pytorch_tanh", "in_channels": 3, "patch_size": 16,
              "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": text["hidden_size"], **vision}
    return {"architectures": [architecture], "model_type": model_type, "text_config": text,
            "vision_config": dict(sorted(vision.items())), "tie_word_embeddings": text["tie_word_embeddings"],
            **_QWEN_VISION_TOKENS}


def gemma3_image_processor_config(vision: dict[str, Any]) -> dict[str, Any]:
    """preprocessor_config.json for Gemma3ImageProcessor: every image resized to the tower's square, no crops."""
    side = vision["image_size"]
    return {"image_processor_type": "Gemma3ImageProcessor", "size": {"height": side, "width": side},
            "do_resize": True, "resample": 2, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
            "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_convert_rgb": True,
            "do_pan_and_scan": False}


def gemma4_image_processor_config(vision: dict[str, Any]) -> dict[str, Any]:
    """preprocessor_config.json for Gemma4ImageProcessor: aspect-preserving, at most ``max_soft_tokens`` a picture."""
    return {"image_processor_type": "Gemma4ImageProcessor", "patch_size": vision.get("patch_size", 16),
            "max_soft_tokens": vision.get("max_soft_tokens", 280),
            "pooling_kernel_size": vision.get("pooling_kernel_size", 3), "do_resize": True, "resample": 3,
            "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": False, "do_convert_rgb": True}


def image_processor_config(vision: dict[str, Any], max_pixels: int) -> dict[str, Any]:
    """preprocessor_config.json for transformers' Qwen2-VL image processor (the one Qwen3.5 / 3.6 use)."""
    merge = vision.get("spatial_merge_size", 2)
    side = vision.get("patch_size", 16) * merge
    return {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": vision.get("patch_size", 16),
            "temporal_patch_size": vision.get("temporal_patch_size", 2), "merge_size": merge,
            "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
            "size": {"shortest_edge": side * side, "longest_edge": max_pixels}}


def write_model_configs(
    out_dir: Path, model_type: str, dims: DecoderDims, tokens: TokenizerInfo, extra: dict[str, Any] | None = None,
    vision: dict[str, Any] | None = None,
) -> None:
    """config.json and generation_config.json; ``vision``: the tower's sizes, for the vision-language layout
    (`vlm_config`, with its preprocessor_config.json)."""
    config = decoder_config(model_type, dims, tokens, extra)
    if vision is not None:
        config = vlm_config(config, vision)
        if config["model_type"] == "gemma3":
            write_json(out_dir / "preprocessor_config.json", gemma3_image_processor_config(vision))
        elif config["model_type"] == "gemma4":
            write_json(out_dir / "preprocessor_config.json", gemma4_image_processor_config(vision))
        elif config["model_type"] != "muse_glimmer":  # (Qwen's processor; kvserve serves Muse-Glimmer text only)
            write_json(out_dir / "preprocessor_config.json", image_processor_config(vision, 256 * 256))
    write_json(out_dir / "config.json", config)
    write_json(out_dir / "generation_config.json", generation_config(tokens))
