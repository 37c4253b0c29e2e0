"""Configuration: the engine's knobs (`EngineConfig`) and the model shape read from an HF `config.json` (`ModelConfig`).

This module imports no torch at load time, so the scheduler (which reads `EngineConfig`) stays free of it.
Every `EngineConfig` field carries its command-line help in `metadata["help"]`: the CLI builds its engine flags
from these fields (server/engine_args.py), so a default lives in exactly one place.
"""
from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral")


class SchedulingPolicy(enum.StrEnum):
    """Order in which waiting requests are admitted."""

    FCFS = "fcfs"  # arrival order
    LONGEST_PREFIX = "longest_prefix"  # the waiting request with the longest cached prefix first


class EvictionPolicy(enum.StrEnum):
    """Which unreferenced cached leaf block is evicted first."""

    LRU = "lru"  # least recently used
    FIFO = "fifo"  # oldest cached


def _help(text: str, **extra: Any) -> dict[str, Any]:
    return {"help": text, **extra}


@dataclass
class EngineConfig:
    block_size: int = field(default=16, metadata=_help("tokens per KV block (power of two)"))
    num_kv_blocks: int | None = field(
        default=None, metadata=_help("KV blocks in the pool (default: from the memory budget)"))
    kv_cache_memory_gb: float = field(
        default=1.0, metadata=_help("KV cache budget on CPU in GiB, when --num-kv-blocks is not given"))
    gpu_memory_utilization: float = field(
        default=0.9, metadata=_help("fraction of GPU memory for weights + activations + KV cache"))
    max_num_seqs: int = field(default=64, metadata=_help("sequences batched together at most"))
    max_num_batched_tokens: int = field(default=2048, metadata=_help("tokens computed per engine step at most"))
    max_model_len: int | None = field(default=None, metadata=_help("context length cap (default: the model's)"))
    enable_prefix_caching: bool = field(
        default=True, metadata=_help("share KV blocks of common prefixes between requests", flag="no-prefix-cache"))
    scheduling_policy: SchedulingPolicy = field(
        default=SchedulingPolicy.FCFS, metadata=_help("order of admitting waiting requests"))
    eviction_policy: EvictionPolicy = field(
        default=EvictionPolicy.LRU, metadata=_help("which unreferenced cached block is evicted first"))
    device: str | None = field(default=None, metadata=_help("cpu or cuda[:N] (default: cuda when a GPU is visible)"))
    dtype: str | None = field(
        default=None, metadata=_help("float32, bfloat16 or float16 (default: float32 on CPU, bfloat16 on CUDA)"))
    attention_backend: str | None = field(
        default=None, metadata=_help("kernels: torch or triton (default: triton on CUDA, torch elsewhere)",
                                     choices=("torch", "triton")))
    enforce_eager: bool = field(default=False, metadata=_help("CUDA: run decode batches eagerly, without CUDA graphs"))
    async_scheduling: bool | None = field(
        default=None, metadata=_help("prepare step N+1 on the host while step N runs on the device "
                                     "(default: on for CUDA, off for CPU)"))
    seed: int = field(default=0, metadata=_help("seed of the default random generator (requests without a seed)",
                                                flag="engine-seed", dest="engine_seed"))
    max_pinned_fraction: float = field(
        default=0.5, metadata=_help("the largest fraction of the KV pool that retained blocks (cache_control pins, "
                                    "named caches, sessions held across tool calls) may take"))
    tool_call_ttl: float = field(
        default=30.0, metadata=_help("seconds a session's KV blocks stay retained after a reply that ends in tool "
                                     "calls, so the turn with the tool result finds them (0: off)"))
    kv_offload_gb: float = field(
        default=0.0, metadata=_help("host memory (GiB) for KV blocks evicted from the device pool; a later hit "
                                    "copies them back instead of recomputing them (0: off)"))
    kv_disk_dir: str | None = field(
        default=None, metadata=_help("directory for a disk KV tier behind the host pool (needs --kv-offload-gb); "
                                     "it survives restarts of the same model and settings"))
    kv_disk_gb: float = field(default=16.0, metadata=_help("size of the disk KV tier in GiB"))
    kv_events_endpoint: str | None = field(
        default=None, metadata=_help("publish vLLM-format KV cache events on this ZMQ PUB endpoint, e.g. tcp://*:5557 "
                                     "(docs/ROUTERS.md)"))
    kv_events_replay_endpoint: str | None = field(
        default=None, metadata=_help("ZMQ ROUTER endpoint that replays missed KV event batches, e.g. tcp://*:5558"))
    kv_events_topic: str = field(default="", metadata=_help("topic frame of every KV event message"))

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be positive, got {self.num_kv_blocks}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if not 0 <= self.max_pinned_fraction <= 1:
            raise ValueError(f"max_pinned_fraction must be in [0, 1], got {self.max_pinned_fraction}")
        if self.tool_call_ttl < 0 or self.kv_offload_gb < 0 or self.kv_disk_gb <= 0:
            raise ValueError("tool_call_ttl and kv_offload_gb must be >= 0, kv_disk_gb > 0")
        if self.kv_disk_dir and not self.kv_offload_gb:
            raise ValueError("the disk KV tier (kv_disk_dir) is written through the host pool: set kv_offload_gb too")
        self.scheduling_policy = _enum_value(SchedulingPolicy, self.scheduling_policy, "scheduling_policy")
        self.eviction_policy = _enum_value(EvictionPolicy, self.eviction_policy, "eviction_policy")
        if self.device is None:
            import torch

            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        on_cuda = self.device.startswith("cuda")
        if self.dtype is None:
            self.dtype = "bfloat16" if on_cuda else "float32"
        if self.attention_backend is None:
            self.attention_backend = "triton" if on_cuda else "torch"
        if self.attention_backend not in ("torch", "triton"):
            raise ValueError(f"attention_backend must be 'torch' or 'triton', got {self.attention_backend!r}")
        if self.async_scheduling is None:
            self.async_scheduling = on_cuda

    @property
    def torch_dtype(self) -> "torch.dtype":
        import torch

        dtype = getattr(torch, self.dtype or "", None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {self.dtype!r}; use float32, bfloat16 or float16")
        return dtype


def _enum_value(kind: type[enum.Enum], value: Any, name: str) -> Any:
    try:
        return kind(value)
    except ValueError:
        valid = ", ".join(repr(m.value) for m in kind)
        raise ValueError(f"{name} must be one of {valid}, got {value!r}") from None


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
