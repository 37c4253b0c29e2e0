"""Randomly drawn valid configurations of every architecture kvserve serves, written as transformers would save them.

The registry's tiny models are one configuration per architecture, the one the code was written around; a bug that
needs another mix (a compression rate larger than a head, a window smaller than a block, a layer kind missing) hides
there. Each architecture here has a `draw` that picks layer counts and kinds, head counts, ranks, windows, top-k and
rates from a seeded generator, within what transformers accepts. A drawn configuration is saved through transformers'
own config class (the released layout and defaults), with the tiny models' random weights
(`engine.model_sources.tiny.write_random_weights`: scales that make greedy outputs varied) and a real tokenizer.

Greedy equality means something only where greedy choices are not near-ties: `hf_greedy_with_margin` returns the
smallest gap between the first and second logit over the reference's steps, and the sweep draws again (the next
seed) for a configuration and prompt set whose gap is under `MIN_MARGIN`.
"""
from __future__ import annotations

import itertools
import math
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

VOCAB = 2048  # model vocabulary: small, so that the LM head does not dominate; prompts draw ids below it
MIN_MARGIN = 1e-3  # fp32 engines differ from transformers by ~1e-5 in a logit: a gap 100x that is not a tie
QWEN_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class Drawn:
    """One drawn configuration: its architecture, config.json keys and the boundaries its prompts should cross."""

    architecture: str
    config: dict[str, Any]
    block_size: int
    boundaries: tuple[int, ...]  # windows, compression rates, chunk sizes a prompt should end below and above

    @property
    def tokenizer(self) -> str:
        return "deepseek" if self.architecture.startswith("deepseek") else "qwen3"


def _pick(rng: random.Random, *choices):
    return rng.choice(choices)


def _dense(rng: random.Random) -> dict[str, Any]:
    heads = _pick(rng, 2, 4, 6, 8)
    kv_heads = _pick(rng, *[d for d in (1, 2, 3, 4, 8) if heads % d == 0 and d <= heads])
    head_dim = _pick(rng, 8, 16, 32)
    return dict(vocab_size=VOCAB, hidden_size=_pick(rng, 32, 48, 64), intermediate_size=_pick(rng, 48, 96, 128),
                num_hidden_layers=rng.randint(1, 4), num_attention_heads=heads, num_key_value_heads=kv_heads,
                head_dim=head_dim, max_position_embeddings=4096, rms_norm_eps=1e-6,
                rope_theta=_pick(rng, 10_000.0, 1_000_000.0), tie_word_embeddings=rng.random() < 0.5)


def _llama(rng: random.Random) -> dict[str, Any]:
    cfg = _dense(rng)
    if rng.random() < 0.5:  # Llama 3's rope scaling
        cfg["rope_scaling"] = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                   original_max_position_embeddings=64)
    return cfg


def _mistral(rng: random.Random) -> dict[str, Any]:
    return dict(_dense(rng), sliding_window=None)  # a window is a sliding-window model (issue 37), not this one


def _qwen3_moe(rng: random.Random) -> dict[str, Any]:
    cfg = _dense(rng)
    experts = _pick(rng, 4, 8, 16)
    layers = cfg["num_hidden_layers"]
    return dict(cfg, num_experts=experts, num_experts_per_tok=rng.randint(1, min(4, experts)),
                moe_intermediate_size=_pick(rng, 16, 32), norm_topk_prob=rng.random() < 0.5,
                decoder_sparse_step=_pick(rng, 1, 2),
                mlp_only_layers=sorted(rng.sample(range(layers), rng.randint(0, layers - 1))))


def _mla(rng: random.Random) -> dict[str, Any]:
    """DeepSeek-V2 / V3's multi-head latent attention and routed experts."""
    heads, layers = _pick(rng, 2, 4), rng.randint(1, 4)
    experts = _pick(rng, 4, 8, 16)
    groups = _pick(rng, *[g for g in (1, 2, 4) if experts // g >= 2])  # V3 ranks a group by its best two experts
    rope = _pick(rng, 8, 16)
    return dict(vocab_size=VOCAB, hidden_size=_pick(rng, 32, 64), intermediate_size=_pick(rng, 64, 128),
                moe_intermediate_size=_pick(rng, 16, 32), num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=heads, q_lora_rank=_pick(rng, None, 24, 48), kv_lora_rank=_pick(rng, 16, 32),
                qk_nope_head_dim=_pick(rng, 8, 16), qk_rope_head_dim=rope, head_dim=rope, v_head_dim=_pick(rng, 8, 16),
                n_routed_experts=experts, n_shared_experts=_pick(rng, 1, 2),
                num_experts_per_tok=rng.randint(1, min(4, experts // groups * min(2, groups))),
                n_group=groups, topk_group=rng.randint(1, groups), first_k_dense_replace=rng.randint(0, layers - 1),
                routed_scaling_factor=_pick(rng, 1.0, 2.5), norm_topk_prob=rng.random() < 0.5,
                max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=10_000.0, tie_word_embeddings=False)


def _deepseek_v2(rng: random.Random) -> dict[str, Any]:
    cfg = _mla(rng)
    cfg["topk_method"] = "group_limited_greedy" if cfg["n_group"] > 1 else "greedy"
    return cfg


def _deepseek_v3(rng: random.Random) -> dict[str, Any]:
    cfg = _mla(rng)
    if rng.random() < 0.5:
        cfg["rope_scaling"] = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64,
                                   beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)
    return cfg


def _deepseek_v32(rng: random.Random) -> dict[str, Any]:
    # At least 8 index heads: a key scores exactly 0 when every head's relu is 0 (1 in 2^heads), and with fewer than
    # top-k keys scoring above 0 the choice among the zeros is a tie that transformers' one-shot prefill and a chunked
    # one break differently (4 heads did, for GLM-5's draw 2). V3.2's queries always come from a q-LoRA latent.
    return dict(_deepseek_v3(rng), q_lora_rank=_pick(rng, 24, 48), index_n_heads=_pick(rng, 8, 16), index_head_dim=_pick(rng, 16, 32),
                index_topk=_pick(rng, 4, 8, 16))


def _glm_moe_dsa(rng: random.Random) -> dict[str, Any]:
    """GLM-5: V3.2's indexer (interleaved index keys) with one expert group and any schedule of layers that reuse the
    last indexed layer's top-k (indexer_types; the first one indexes)."""
    cfg = dict(_deepseek_v32(rng), n_group=1, topk_group=1)
    cfg["indexer_types"] = ["full"] + [_pick(rng, "full", "shared") for _ in range(cfg["num_hidden_layers"] - 1)]
    return cfg


def _glm4_moe_lite(rng: random.Random) -> dict[str, Any]:
    """GLM-4.7-Flash: DeepSeek-V3's MLA and routing with any dense / sparse layer schedule (mlp_layer_types) and
    rotary pairs interleaved or not."""
    cfg = _mla(rng)
    kinds = [_pick(rng, "dense", "sparse") for _ in range(cfg.pop("num_hidden_layers"))]
    return dict(cfg, num_hidden_layers=len(kinds), mlp_layer_types=kinds, rope_interleave=rng.random() < 0.5)


def _minimax_m2(rng: random.Random) -> dict[str, Any]:
    """MiniMax-M2: GQA with q/k norms across heads, partial RoPE (rotary_dim of a head), an MoE in every layer with
    sigmoid scores and a correction bias."""
    cfg = _dense(rng)
    experts = _pick(rng, 4, 8, 16)
    return dict(cfg, num_local_experts=experts, num_experts_per_tok=rng.randint(1, min(4, experts)),
                intermediate_size=_pick(rng, 16, 32), rotary_dim=_pick(rng, cfg["head_dim"] // 2, cfg["head_dim"]))


def _ministral3(rng: random.Random) -> dict[str, Any]:
    """Ministral 3: Mistral's decoder with YaRN and Llama 4's query temperature, whose trained length is short here
    so that prompts cross it."""
    cfg = _dense(rng)
    rope = dict(type="yarn", rope_theta=cfg.pop("rope_theta"), factor=4.0, beta_fast=32.0, beta_slow=1.0, mscale=1.0,
                mscale_all_dim=1.0, original_max_position_embeddings=_pick(rng, 8, 16),
                llama_4_scaling_beta=_pick(rng, 0.1, 0.5))
    return dict(cfg, sliding_window=None, rope_parameters=rope)


def _mistral3(rng: random.Random) -> dict[str, Any]:
    """The released VLM layout (Devstral Small 2): the language model beside a Pixtral tower and the projector."""
    text = dict(_ministral3(rng), model_type="ministral3")
    return dict(text_config=text, tie_word_embeddings=text["tie_word_embeddings"],  # transformers reads the VLM's
                vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                   head_dim=16, image_size=32, patch_size=8))


V4_KINDS = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")


def _deepseek_v4(rng: random.Random) -> dict[str, Any]:
    layers = rng.randint(1, 4)
    head_dim = _pick(rng, 16, 32)
    rope = _pick(rng, 8, head_dim // 2)  # the indexer rotates the same trailing dims of its keys: index_head_dim >= it
    experts = _pick(rng, 4, 8)
    return dict(vocab_size=VOCAB, hidden_size=_pick(rng, 32, 64), moe_intermediate_size=_pick(rng, 16, 32),
                num_hidden_layers=layers, num_attention_heads=_pick(rng, 2, 4), num_key_value_heads=1,
                head_dim=head_dim, q_lora_rank=_pick(rng, 16, 32), n_routed_experts=experts,
                num_experts_per_tok=rng.randint(1, 2), n_shared_experts=1, o_groups=_pick(rng, 1, 2),
                o_lora_rank=_pick(rng, 8, 16), index_n_heads=_pick(rng, 4, 8), index_head_dim=_pick(rng, rope, 16),
                index_topk=_pick(rng, 2, 4, 8), sliding_window=_pick(rng, 4, 8, 16, 24),
                qk_rope_head_dim=rope, hc_mult=_pick(rng, 1, 2, 4),
                num_hash_layers=rng.randint(0, layers),
                compress_rates={"compressed_sparse_attention": _pick(rng, 2, 4),
                                "heavily_compressed_attention": _pick(rng, 8, 16)},  # 128: test_deepseek_v4.py
                layer_types=[rng.choice(V4_KINDS) for _ in range(layers)], max_position_embeddings=4096,
                tie_word_embeddings=False, rms_norm_eps=1e-6)


_LINEAR = ("linear_attention", "full_attention")


def _hybrid_text(rng: random.Random) -> dict[str, Any]:
    """Qwen3-Next / 3.5: Gated DeltaNet layers between gated full attention, any mix with at least one of each."""
    layers = rng.randint(2, 4)
    kinds = [rng.choice(_LINEAR) for _ in range(layers)]
    kinds[rng.randrange(layers)] = "full_attention"
    if "linear_attention" not in kinds:
        kinds[rng.choice([i for i in range(layers) if i != kinds.index("full_attention")])] = "linear_attention"
    heads = _pick(rng, 2, 4)
    key_heads = _pick(rng, 1, 2)
    return dict(vocab_size=VOCAB, hidden_size=_pick(rng, 32, 64), intermediate_size=_pick(rng, 64, 128),
                num_hidden_layers=layers, layer_types=kinds, num_attention_heads=heads,
                num_key_value_heads=_pick(rng, *[d for d in (1, 2) if heads % d == 0]), head_dim=_pick(rng, 16, 32),
                linear_conv_kernel_dim=_pick(rng, 2, 4), linear_key_head_dim=_pick(rng, 8, 16),
                linear_value_head_dim=_pick(rng, 8, 16), linear_num_key_heads=key_heads,
                linear_num_value_heads=key_heads * _pick(rng, 1, 2), max_position_embeddings=4096,
                tie_word_embeddings=rng.random() < 0.5, rms_norm_eps=1e-6)


def _hybrid_moe(rng: random.Random) -> dict[str, Any]:
    experts = _pick(rng, 4, 8)
    return dict(num_experts=experts, num_experts_per_tok=rng.randint(1, min(3, experts)),
                moe_intermediate_size=_pick(rng, 16, 32), shared_expert_intermediate_size=_pick(rng, 16, 48))


def _rope(rng: random.Random, mrope: bool) -> dict[str, Any]:
    rope = dict(rope_type="default", rope_theta=_pick(rng, 10_000.0, 1e6), partial_rotary_factor=0.25)
    return dict(rope, mrope_section=[2, 1, 1], mrope_interleaved=True) if mrope else rope


def _kimi_linear(rng: random.Random) -> dict[str, Any]:
    """Kimi Linear: KDA (a decay per key channel) and MLA without RoPE in any mix with at least one of each, DeepSeek-V3's
    routing after any dense / sparse schedule (transformers' KimiLinearConfig names)."""
    mla, kinds = _mla(rng), _hybrid_text(rng)["layer_types"]
    for key in ("n_routed_experts", "n_group", "topk_group", "first_k_dense_replace", "num_hidden_layers",
                "max_position_embeddings", "rope_theta", "head_dim"):
        mla.pop(key)
    return dict(mla, num_local_experts=_pick(rng, 4, 8), n_group=1, topk_group=1, num_hidden_layers=len(kinds),
                layer_types=kinds, mlp_layer_types=[_pick(rng, "dense", "sparse") for _ in kinds],
                linear_num_heads=_pick(rng, 1, 2, 4), linear_head_dim=_pick(rng, 8, 16),
                linear_conv_kernel_dim=_pick(rng, 2, 4), pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _qwen3_next(rng: random.Random) -> dict[str, Any]:
    return dict(_hybrid_text(rng), **_hybrid_moe(rng), rope_parameters=_rope(rng, mrope=False))


_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16, num_position_embeddings=64)


def _qwen3_5(rng: random.Random) -> dict[str, Any]:
    """The released VLM layout: the language model's config in text_config, beside a vision tower's."""
    text = dict(_hybrid_text(rng), rope_parameters=_rope(rng, mrope=True))
    return dict(text_config=text, vision_config=dict(_VISION, out_hidden_size=text["hidden_size"]))


def _qwen3_5_moe(rng: random.Random) -> dict[str, Any]:
    text = dict(_hybrid_text(rng), **_hybrid_moe(rng), rope_parameters=_rope(rng, mrope=True))
    text.pop("intermediate_size")
    return dict(text_config=text, vision_config=dict(_VISION, out_hidden_size=text["hidden_size"]))


def _qwen3_5_text(rng: random.Random) -> dict[str, Any]:
    """A Qwen3.5 language model saved alone (its own model_type, no vision tower)."""
    return _qwen3_5(rng)["text_config"]


def _qwen3_5_moe_text(rng: random.Random) -> dict[str, Any]:
    return _qwen3_5_moe(rng)["text_config"]


GEMMA_KINDS = ("sliding_attention", "full_attention")


def _gemma3_text(rng: random.Random) -> dict[str, Any]:
    """Gemma 3: any mix of local (sliding-window) and global layers, their own RoPE bases (and a scaled global one),
    query_pre_attn_scalar, optional final logit softcapping."""
    layers = rng.randint(2, 6)
    kinds = [rng.choice(GEMMA_KINDS) for _ in range(layers)]
    kinds[rng.randrange(layers)] = "sliding_attention"
    heads = _pick(rng, 2, 4)
    head_dim = _pick(rng, 16, 32)
    rope = {"full_attention": dict(rope_type="default", rope_theta=1e6),
            "sliding_attention": dict(rope_type="default", rope_theta=1e4)}
    if rng.random() < 0.5:  # the 4B-and-up layout: the global layers' RoPE scaled linearly
        rope["full_attention"] = dict(rope_type="linear", factor=8.0, rope_theta=1e6)
    return dict(vocab_size=VOCAB, hidden_size=_pick(rng, 32, 64), intermediate_size=_pick(rng, 64, 128),
                num_hidden_layers=layers, layer_types=kinds, num_attention_heads=heads,
                num_key_value_heads=_pick(rng, *[d for d in (1, 2) if heads % d == 0]), head_dim=head_dim,
                query_pre_attn_scalar=_pick(rng, head_dim, 24), sliding_window=_pick(rng, 4, 8, 12, 24),
                rope_parameters=rope, final_logit_softcapping=_pick(rng, None, 4.0, 30.0),
                max_position_embeddings=4096, pad_token_id=0, eos_token_id=1, bos_token_id=2)


def _gemma3(rng: random.Random) -> dict[str, Any]:
    """The released VLM layout: the language model beside a SigLIP tower and the projector."""
    return dict(text_config=_gemma3_text(rng), mm_tokens_per_image=4,
                vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                   image_size=32, patch_size=8))


def _gemma4_text(rng: random.Random) -> dict[str, Any]:
    """Gemma 4: any mix of window and global layers (the last one global, as transformers forces), global layers
    of a wider head with their own KV heads whose values may come from k_proj, proportional RoPE on them, optional
    final logit softcapping, half the time 26B-A4B's MoE block beside the dense MLPs, and half the time E2B / E4B's
    per-layer embeddings and shared KV layers (`_gemma4_per_layer`)."""
    layers = rng.randint(2, 6)
    kinds = [rng.choice(GEMMA_KINDS) for _ in range(layers - 1)] + ["full_attention"]
    kinds[rng.randrange(layers - 1)] = "sliding_attention"
    heads = _pick(rng, 2, 4)
    head_dim = _pick(rng, 16, 32)
    rope = {"full_attention": dict(rope_type="proportional", partial_rotary_factor=_pick(rng, 0.25, 0.5, 1.0),
                                   rope_theta=1e6),
            "sliding_attention": dict(rope_type="default", rope_theta=1e4)}
    text = dict(vocab_size=VOCAB, hidden_size=_pick(rng, 32, 64), intermediate_size=_pick(rng, 64, 128),
                num_hidden_layers=layers, layer_types=kinds, num_attention_heads=heads,
                num_key_value_heads=_pick(rng, *[d for d in (1, 2) if heads % d == 0]), head_dim=head_dim,
                global_head_dim=_pick(rng, head_dim, 2 * head_dim), attention_k_eq_v=rng.random() < 0.5,
                num_global_key_value_heads=_pick(rng, *[d for d in (1, 2) if heads % d == 0]),
                sliding_window=_pick(rng, 4, 8, 12, 24), rope_parameters=rope, hidden_size_per_layer_input=0,
                final_logit_softcapping=_pick(rng, None, 4.0, 30.0), max_position_embeddings=4096, pad_token_id=0,
                eos_token_id=1, bos_token_id=2,
                **(dict(enable_moe_block=True, num_experts=_pick(rng, 4, 8), top_k_experts=_pick(rng, 1, 2),
                        moe_intermediate_size=_pick(rng, 16, 32)) if rng.random() < 0.5 else {}))
    return {**text, **_gemma4_per_layer(rng, kinds)}


def _gemma4_per_layer(rng: random.Random, kinds: list[str]) -> dict[str, Any]:
    """Half the time, E2B / E4B's keys: per-layer inputs of 4-16 dims and, where there are layers after the first of
    each kind, all of them sharing the K / V of the last earlier layer of their kind (transformers' rule: as many as
    it allows; E2B's twice-as-wide MLPs are gemma4-e2b-tiny's). From a generator of its own, seeded by ``rng``'s
    state without advancing it: the other keys and the block size are drawn as before, and a switch of their own
    would be a kind the kept draws could not all cover."""
    rng = random.Random(str(rng.getstate()))
    if rng.random() < 0.5:
        return {}
    inputs = dict(hidden_size_per_layer_input=_pick(rng, 4, 8, 16), vocab_size_per_layer_input=VOCAB)
    shareable = len(kinds) - 1 - max(kinds.index(kind) for kind in set(kinds))  # after every kind has a source
    if not shareable:
        return inputs
    return dict(inputs, num_kv_shared_layers=shareable)


def _gemma4(rng: random.Random) -> dict[str, Any]:
    """The released VLM layout (Gemma-4-31B's): the language model beside a vision tower."""
    return dict(text_config=_gemma4_text(rng), audio_config=None,
                vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=2, head_dim=16, patch_size=8, position_embedding_size=64))


def _muse_glimmer(rng: random.Random) -> dict[str, Any]:
    """Muse-Glimmer (released only as its VLM): any mix of window and full layers, each with RoPE or none (NoPE,
    ``layer_rope_theta`` 0), the q scale and logit multiplier drawn."""
    layers = rng.randint(2, 6)
    kinds = [rng.choice(GEMMA_KINDS) for _ in range(layers)]
    kinds[rng.randrange(layers)] = "sliding_attention"
    heads = _pick(rng, 2, 4)
    text = dict(vocab_size=VOCAB, hidden_size=_pick(rng, 32, 64), intermediate_size=_pick(rng, 64, 128),
                num_hidden_layers=layers, layer_types=kinds, num_attention_heads=heads,
                num_key_value_heads=_pick(rng, *[d for d in (1, 2) if heads % d == 0]), head_dim=_pick(rng, 16, 32),
                layer_rope_theta=[_pick(rng, 0, 10_000.0) for _ in range(layers)],
                rope_parameters=dict(rope_type="default", rope_theta=10_000.0), sliding_window=_pick(rng, 4, 8, 12),
                qk_scale_factor=_pick(rng, 1.0, 3.87), output_multiplier=_pick(rng, 0.2, 1.0),
                max_position_embeddings=4096, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    return dict(text_config=text, out_hidden_size=128, projector_hidden_size=64,
                vision_config=dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2))


def _gpt_oss(rng: random.Random) -> dict[str, Any]:
    """gpt-oss: any mix of window and full layers (at least one window layer), attention sinks, top-k of 4-8 experts
    with biases, the SwiGLU clamp, YaRN (as released, untruncated) or plain RoPE."""
    layers = rng.randint(2, 4)
    kinds = [rng.choice(GEMMA_KINDS) for _ in range(layers)]
    kinds[rng.randrange(layers)] = "sliding_attention"
    heads = _pick(rng, 2, 4, 8)
    experts = _pick(rng, 4, 8)
    rope = _pick(rng, dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                           original_max_position_embeddings=256, rope_theta=150000.0),
                 dict(rope_type="default", rope_theta=10000.0))
    return dict(vocab_size=VOCAB, hidden_size=_pick(rng, 32, 64), intermediate_size=_pick(rng, 32, 64),
                num_hidden_layers=layers, layer_types=kinds, num_attention_heads=heads,
                num_key_value_heads=_pick(rng, *[d for d in (1, 2, 4) if heads % d == 0]), head_dim=_pick(rng, 16, 32),
                num_local_experts=experts, num_experts_per_tok=rng.randint(1, 4), sliding_window=_pick(rng, 4, 8, 12),
                swiglu_limit=_pick(rng, 7.0, 1.5), rope_parameters=rope, max_position_embeddings=4096,
                pad_token_id=0, eos_token_id=1)


DRAWS: dict[str, Callable[[random.Random], dict[str, Any]]] = {
    "llama": _llama, "qwen2": _dense, "qwen3": _dense, "mistral": _mistral, "qwen3_moe": _qwen3_moe,
    "deepseek_v2": _deepseek_v2, "deepseek_v3": _deepseek_v3, "deepseek_v32": _deepseek_v32,
    "deepseek_v4": _deepseek_v4, "qwen3_next": _qwen3_next, "qwen3_5": _qwen3_5, "qwen3_5_moe": _qwen3_5_moe,
    "qwen3_5_text": _qwen3_5_text, "qwen3_5_moe_text": _qwen3_5_moe_text, "gemma3_text": _gemma3_text,
    "gemma3": _gemma3, "glm4_moe_lite": _glm4_moe_lite, "glm_moe_dsa": _glm_moe_dsa, "minimax_m2": _minimax_m2, "kimi_linear": _kimi_linear, "ministral3": _ministral3, "mistral3": _mistral3, "gpt_oss": _gpt_oss,
    "gemma4_text": _gemma4_text, "gemma4": _gemma4, "muse_glimmer": _muse_glimmer,
}


def draw(architecture: str, seed: int) -> Drawn:
    """The ``seed``-th drawn configuration of ``architecture`` (the same on every machine)."""
    rng = random.Random(f"{architecture}:{seed}")
    config = DRAWS[architecture](rng)
    text = config.get("text_config", config)
    bounds = [text.get("sliding_window") or 0]
    if architecture == "deepseek_v4":
        rates = [config["compress_rates"][kind] for kind in set(config["layer_types"]) if kind != V4_KINDS[0]]
        block = math.lcm(4, *rates)
        bounds += rates
    else:
        block = _pick(rng, 4, 8, 16)
    return Drawn(architecture, config, block, tuple(sorted({b for b in bounds if b})))


def features(drawn: Drawn) -> tuple[set, set]:
    """What ``drawn`` exercises: its kinds (every non-numeric choice: layer kinds, RoPE types, tying, softcaps on or
    off, ...) and block size; and beside them every (key, value) it drew, sizes and windows included."""
    kinds: set = {("block", drawn.block_size)}
    values: set = set()

    def walk(key: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{key}.{k}", v)
        elif isinstance(value, list):
            for v in value:
                walk(key + "[]", v)
        else:
            values.add((key, repr(value)))
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                kinds.add((key, repr(value)))

    walk("", drawn.config)
    return kinds, values


def covering_draws(architecture: str, candidates: int, kept: int) -> tuple[int, ...]:
    """The first draw and the ``kept - 1`` others of the first ``candidates`` that together exercise the most of what
    they all do (kinds first, then every drawn value): a draw that only repeats the others' kinds is the one left
    out. Seeded, so the same indices on every machine."""
    drawn = [features(draw(architecture, i)) for i in range(candidates)]

    def coverage(indices: tuple[int, ...]) -> tuple[int, int]:
        return tuple(len(set().union(*(drawn[i][part] for i in indices))) for part in (0, 1))

    return max(((0,) + rest for rest in itertools.combinations(range(1, candidates), kept - 1)), key=coverage)


def write_checkpoint(drawn: Drawn, out: Path, seed: int) -> Path:
    """``drawn`` saved by transformers' config class, with the tiny models' random weights and a real tokenizer."""
    from transformers import AutoConfig

    from engine.model_sources.deepseek_tokenizer import write_deepseek_tokenizer
    from engine.model_sources.tiny import write_random_weights
    from engine.registry import resolve_model

    out.mkdir(parents=True, exist_ok=True)
    config = AutoConfig.for_model(drawn.architecture, **drawn.config)
    if drawn.architecture.startswith("gemma") or "vision_config" in drawn.config:
        _save_by_model_class(config, out, seed)
    else:
        config.save_pretrained(out)
        write_random_weights(out, seed)
    if drawn.tokenizer == "deepseek":
        write_deepseek_tokenizer(out, "deepseek-v4")
    else:
        source = resolve_model("qwen3-tiny")
        for name in QWEN_TOKENIZER_FILES:
            shutil.copyfile(source / name, out / name)
    return out


# A valid DeepSeek-V4 configuration the registry's tiny model is not: transformers' default layer_types (three heavily
# compressed layers pooling 128 tokens, more than the 32-dim head, then one compressed-sparse layer), a window of 8
# inside a block, transformers' own random init. It crashed every prompt (zero-width entry tensors) and needed
# --block-size 128.
V4_OF_TRANSFORMERS_DEFAULTS = dict(
    vocab_size=129280, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=1, head_dim=32, q_lora_rank=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
    o_groups=2, o_lora_rank=16, index_n_heads=8, index_head_dim=16, index_topk=4, sliding_window=8,
    qk_rope_head_dim=8, hc_mult=2, initializer_range=0.3)


def write_v4_of_transformers_defaults(out: Path):
    """`V4_OF_TRANSFORMERS_DEFAULTS` with transformers' init (seed 0), saved with the DeepSeek tokenizer into ``out``;
    returns the transformers model."""
    import transformers

    from engine.model_sources.deepseek_tokenizer import write_deepseek_tokenizer

    torch.manual_seed(0)
    config = transformers.DeepseekV4Config(**V4_OF_TRANSFORMERS_DEFAULTS)
    model = transformers.DeepseekV4ForCausalLM(config).eval()
    model.save_pretrained(out)
    write_deepseek_tokenizer(out, "deepseek-v4")
    return model


def _save_by_model_class(config, out: Path, seed: int) -> None:
    """The model transformers builds for ``config`` (a VLM with its vision tower, in the released layout), with the
    tiny models' weights of its family (`family_scales`; Gemma 4's layer scalars drawn too), saved by
    save_pretrained."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from engine.model_sources.tiny import family_scales, random_tensor

    vlm = hasattr(config, "vision_config")
    model = (AutoModelForImageTextToText if vlm else AutoModelForCausalLM).from_config(config)
    scales, zero_centered = family_scales(config.model_type)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(random_tensor(name, tuple(param.shape), seed, scales, zero_centered_norms=zero_centered))
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.copy_(random_tensor(name, tuple(buffer.shape), seed, scales))
    model.save_pretrained(out)


_TOKENIZERS: dict[str, Any] = {}


def shared_tokenizer(kind: str, model_dir: Path):
    """The tokenizer of every checkpoint of one kind (the same files), loaded once, from the first such directory: a
    Qwen tokenizer takes seconds to load and tens of MB to hold."""
    from transformers import AutoTokenizer

    if kind not in _TOKENIZERS:
        _TOKENIZERS[kind] = AutoTokenizer.from_pretrained(str(model_dir))
    return _TOKENIZERS[kind]


def hf_greedy_with_margin(model, prompt: list[int], max_new_tokens: int) -> tuple[list[int], float]:
    """Transformers' greedy continuation of ``prompt`` and the smallest top-1 / top-2 logit gap over its steps."""
    model.generation_config.eos_token_id = None  # as the engine with ignore_eos: a drawn model may pick EOS
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0, output_logits=True,
                             return_dict_in_generate=True)
    assert out.sequences.shape[1] == len(prompt) + max_new_tokens
    gaps = [float(top[0, 0] - top[0, 1]) for top in (step.float().topk(2).values for step in out.logits)]
    return out.sequences[0, len(prompt):].tolist(), min(gaps)
