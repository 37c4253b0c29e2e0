"""Benchmark models with real shapes and random weights, written on the machine that runs them (nothing downloads).

A model directory is what the hub would give: ``config.json`` with the real checkpoint's keys, sharded
``*.safetensors`` with the real tensor names (Qwen3-MoE experts one by one, as the released checkpoints store them),
an index, and the tokenizer files of a registered tiny model (same vocabulary). Weights are ``N(0, 0.02)`` with
unit norms: enough for timing (``ignore_eos`` workloads), meaningless as text.
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import torch

from engine.model_sources.mxfp4 import QUANTIZATION_CONFIG

# Qwen/Qwen3-0.6B's config.json shape: tied embeddings, 28 layers, GQA 16/8, head_dim 128 (about 1.2 GB in bf16).
QWEN3_0_6B: dict[str, Any] = dict(
    architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=1024,
    intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
    max_position_embeddings=40960, rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
)
# Qwen/Qwen3-30B-A3B's shape: 48 layers of 128 experts (8 routed per token, 768 wide), GQA 32/4, untied head.
QWEN3_30B_A3B: dict[str, Any] = dict(
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936, hidden_size=2048,
    intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
    decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
    head_dim=128, max_position_embeddings=40960, rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
)
# Qwen/Qwen3.6-27B and Qwen/Qwen3.6-35B-A3B: the language models of the released checkpoints (their text_config),
# hybrids of Gated DeltaNet and gated attention.
QWEN36_27B: dict[str, Any] = dict(
    model_type="qwen3_5_text", vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
    num_attention_heads=24, num_key_value_heads=4, head_dim=256, full_attention_interval=4,
    linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
    linear_num_value_heads=48, max_position_embeddings=262144,
)
QWEN36_35B_A3B: dict[str, Any] = dict(
    model_type="qwen3_5_moe_text", vocab_size=248320, hidden_size=2048, num_hidden_layers=40,
    num_attention_heads=16, num_key_value_heads=2, head_dim=256, full_attention_interval=4,
    linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
    linear_num_value_heads=32, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
    shared_expert_intermediate_size=512, max_position_embeddings=262144,
)
# openai/gpt-oss-20b's shape (issue 37): window (128) and full layers alternating, sinks, 32 experts (4 routed) with
# biases, YaRN; its experts MXFP4 as released (quantization_config), kept packed by the engine on the Triton backend.
GPT_OSS_20B: dict[str, Any] = dict(
    architectures=["GptOssForCausalLM"], model_type="gpt_oss", vocab_size=201088, hidden_size=2880,
    intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
    num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
    layer_types=["sliding_attention", "full_attention"] * 12, rope_theta=150_000.0,
    rope_scaling=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                      original_max_position_embeddings=4096),
    max_position_embeddings=131072, attention_bias=True, swiglu_limit=7.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
    quantization_config=QUANTIZATION_CONFIG,
)
# zai-org/GLM-4.7-Flash's shape (issue 38): MLA (q-LoRA 768, latent 512 + 64 rotary, nope 192, values 256) over 20
# heads, a dense first layer, then a shared expert + 4 of 64 routed ones, 47 layers.
GLM_47_FLASH: dict[str, Any] = dict(
    architectures=["Glm4MoeLiteForCausalLM"], model_type="glm4_moe_lite", vocab_size=154880, hidden_size=2048,
    intermediate_size=10240, moe_intermediate_size=1536, num_hidden_layers=47, num_attention_heads=20,
    num_key_value_heads=20, head_dim=64, q_lora_rank=768, kv_lora_rank=512, qk_nope_head_dim=192,
    qk_rope_head_dim=64, v_head_dim=256, n_routed_experts=64, n_shared_experts=1, num_experts_per_tok=4,
    first_k_dense_replace=1, routed_scaling_factor=1.8, n_group=1, topk_group=1, norm_topk_prob=True,
    scoring_func="sigmoid", topk_method="noaux_tc", rope_interleave=True, partial_rotary_factor=1.0,
    rope_theta=1_000_000.0, max_position_embeddings=202752, rms_norm_eps=1e-5, tie_word_embeddings=False,
)
# Keys every released Qwen3 config.json carries besides the shape.
_COMMON_CONFIG = dict(attention_bias=False, hidden_act="silu", bos_token_id=151643, eos_token_id=151645,
                      torch_dtype="bfloat16")
# What a tokenizer directory contributes to a model directory (never weights or config.json).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json",
                   "added_tokens.json", "chat_template.jinja", "generation_config.json")
SHARD_BYTES = 2 * 2**30


def _is_moe_layer(config: dict[str, Any], layer: int) -> bool:
    """Qwen3-MoE's rule: sparse unless listed in ``mlp_only_layers``, every ``decoder_sparse_step``-th layer."""
    return (config["model_type"] == "qwen3_moe" and layer not in config.get("mlp_only_layers", [])
            and (layer + 1) % config.get("decoder_sparse_step", 1) == 0)


def _mlp_shapes(config: dict[str, Any], layer: int, prefix: str) -> dict[str, tuple[int, ...]]:
    hidden = config["hidden_size"]
    if not _is_moe_layer(config, layer):
        width = config["intermediate_size"]
        return {f"{prefix}gate_proj.weight": (width, hidden), f"{prefix}up_proj.weight": (width, hidden),
                f"{prefix}down_proj.weight": (hidden, width)}
    width = config["moe_intermediate_size"]
    shapes = {f"{prefix}gate.weight": (config["num_experts"], hidden)}
    for expert in range(config["num_experts"]):
        p = f"{prefix}experts.{expert}."
        shapes.update({f"{p}gate_proj.weight": (width, hidden), f"{p}up_proj.weight": (width, hidden),
                       f"{p}down_proj.weight": (hidden, width)})
    return shapes


def checkpoint_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of a Qwen3 / Qwen3-MoE checkpoint with this config, as the released files name them."""
    hidden, head_dim = config["hidden_size"], config["head_dim"]
    q_width, kv_width = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config["vocab_size"], hidden)}
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        shapes.update({
            f"{p}input_layernorm.weight": (hidden,), f"{p}post_attention_layernorm.weight": (hidden,),
            f"{p}self_attn.q_proj.weight": (q_width, hidden), f"{p}self_attn.k_proj.weight": (kv_width, hidden),
            f"{p}self_attn.v_proj.weight": (kv_width, hidden), f"{p}self_attn.o_proj.weight": (hidden, q_width),
            f"{p}self_attn.q_norm.weight": (head_dim,), f"{p}self_attn.k_norm.weight": (head_dim,),
        })
        shapes.update(_mlp_shapes(config, layer, f"{p}mlp."))
    shapes["model.norm.weight"] = (hidden,)
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], hidden)
    return shapes


def param_count(config: dict[str, Any], active_only: bool = False) -> int:
    """Parameters of the checkpoint; ``active_only``: those one token reads (its routed experts, not all of them)."""
    total = sum(math.prod(shape) for shape in checkpoint_shapes(config).values())
    if active_only and config["model_type"] == "qwen3_moe":
        expert = 3 * config["moe_intermediate_size"] * config["hidden_size"]
        moe_layers = sum(_is_moe_layer(config, layer) for layer in range(config["num_hidden_layers"]))
        total -= moe_layers * (config["num_experts"] - config["num_experts_per_tok"]) * expert
    return total


def meta_param_count(config: dict[str, Any]) -> int:
    """Parameters of transformers' model for ``config`` (any family), built on the meta device: nothing allocated."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    return sum(p.numel() for p in model.parameters())


def engine_weight_bytes(config: dict[str, Any], packed_experts: bool = False,
                        dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of the engine's weights for ``config`` in ``dtype`` (one rank), built on the meta device: nothing
    allocated. ``packed_experts``: MXFP4 experts kept packed (engine/models/layers/mxfp4_experts.py)."""
    from engine.config import ModelConfig
    from engine.models.architectures import build_model
    from engine.models.layers.mxfp4_experts import use_mxfp4_experts
    from engine.parallel.memory import weight_bytes as rank_weight_bytes

    cfg = ModelConfig.from_dict(config)
    model = build_model(cfg, None, torch.device("meta"), dtype, 1,
                        on_meta=use_mxfp4_experts if packed_experts else None)
    return sum(rank_weight_bytes(model))


def kv_bytes_per_token(config: dict[str, Any], dtype_bytes: int) -> int:
    """K and V of one token in every layer."""
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * dtype_bytes


def weight_bytes(model_dir: Path) -> int:
    """Bytes a forward pass reads from the weights: the safetensors payload (tied embeddings are stored once)."""
    return sum(path.stat().st_size for path in Path(model_dir).glob("*.safetensors"))


def copy_tokenizer(src_dir: Path, dst_dir: Path) -> list[str]:
    copied = [name for name in TOKENIZER_FILES if (src_dir / name).is_file()]
    if "tokenizer.json" not in copied and "vocab.json" not in copied:
        raise FileNotFoundError(f"{src_dir} holds no tokenizer files")
    for name in copied:
        shutil.copyfile(src_dir / name, dst_dir / name)
    return copied


def _shards(shapes: dict[str, tuple[int, ...]], dtype_bytes: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * dtype_bytes
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


@torch.no_grad()
def write_random_checkpoint(out_dir: Path, config: dict[str, Any], device: str = "cpu",
                            dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> None:
    """Sharded safetensors + index for ``config``, generated shard by shard on ``device`` (fast on a GPU)."""
    from safetensors.torch import save_file

    shapes = checkpoint_shapes(config)
    generator = torch.Generator(device).manual_seed(seed)
    shards = _shards(shapes, dtype.itemsize)
    weight_map = {}
    for index, names in enumerate(shards, 1):
        filename = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name in names:
            if name.endswith("norm.weight"):
                tensors[name] = torch.ones(shapes[name], dtype=dtype)
            else:
                values = torch.randn(shapes[name], generator=generator, device=device, dtype=torch.float32)
                tensors[name] = (0.02 * values).to(dtype).cpu()
            weight_map[name] = filename
        save_file(tensors, str(out_dir / filename), metadata={"format": "pt"})
    total = sum(math.prod(shape) for shape in shapes.values()) * dtype.itemsize
    index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2))


def build_bench_model(out_dir: Path, config: dict[str, Any], tokenizer_from: str = "qwen3-tiny",
                      device: str = "cpu", seed: int = 0, weights: bool = True) -> Path:
    """An HF-format directory for ``config`` (bf16 random weights, or none: for an engine with
    ``load_format="dummy"``, which draws them on the device) with the registered ``tokenizer_from``'s tokenizer;
    built with the registry (which builds that tiny model first if needed)."""
    from engine.registry import resolve_model

    out_dir.mkdir(parents=True, exist_ok=True)
    common = _COMMON_CONFIG if config["model_type"].startswith("qwen") else {"torch_dtype": "bfloat16"}
    (out_dir / "config.json").write_text(json.dumps({**common, **config}, indent=2))
    if weights:
        write_random_checkpoint(out_dir, config, device=device, seed=seed)
    copy_tokenizer(resolve_model(tokenizer_from), out_dir)
    return out_dir
