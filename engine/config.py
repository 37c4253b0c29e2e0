"""Configuration: the engine's knobs (`EngineConfig`) and the model shape read from an HF `config.json` (`ModelConfig`)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral")


@dataclass
class EngineConfig:
    block_size: int = 16
    num_kv_blocks: int | None = None  # explicit page count; else derived from kv_cache_memory_gb / GPU memory
    kv_cache_memory_gb: float = 1.0  # KV budget on CPU when num_kv_blocks is not given
    gpu_memory_utilization: float = 0.9  # fraction of GPU memory the engine may use (weights + activations + KV)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # defaults to the model's context length
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"  # or "longest_prefix": admit the waiting request with the longest cached prefix
    device: str = "cpu"
    dtype: str = "float32"
    kv_cache_dtype: str = "auto"  # "auto": the model dtype; "fp8": float8_e4m3fn pages (scale 1.0), half of bf16's bytes
    attention_backend: str | None = None  # "torch" | "triton"; default: triton on CUDA, torch elsewhere
    enforce_eager: bool = False  # on CUDA with Triton, True skips CUDA-graph capture: decode batches run eagerly
    seed: int = 0

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be positive, got {self.num_kv_blocks}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if self.scheduling_policy not in ("fcfs", "longest_prefix"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'longest_prefix', got {self.scheduling_policy!r}")
        if self.attention_backend is None:
            self.attention_backend = "triton" if self.device.startswith("cuda") else "torch"
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8', got {self.kv_cache_dtype!r}")
        if self.attention_backend not in ("torch", "triton"):
            raise ValueError(f"attention_backend must be 'torch' or 'triton', got {self.attention_backend!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {self.dtype!r}; use float32, bfloat16 or float16")
        return dtype

    @property
    def kv_cache_torch_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn if self.kv_cache_dtype == "fp8" else self.torch_dtype


@dataclass
class ModelConfig:
    """The decoder's shape, from an HF config.json of a Llama / Qwen2 / Qwen3 model."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    rope_theta: float
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    eos_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        arch = cfg.get("model_type", "")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"model_type {arch!r} is not supported; kvserve runs {', '.join(SUPPORTED_ARCHITECTURES)} decoders"
            )
        num_heads = cfg["num_attention_heads"]
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        if rope.get("rope_type", rope.get("type", "default")) == "default":
            rope = {}
        eos = cfg.get("eos_token_id")
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", arch == "qwen2"),
            qk_norm=arch == "qwen3",
            rope_theta=rope_theta,
            rope_scaling=rope,
            eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
        )

    @classmethod
    def from_dir(cls, model_dir: Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.exists():
            raise ValueError(f"{model_dir} has no config.json; is it an HF-format model directory?")
        return cls.from_dict(json.loads(path.read_text()))
