"""Configuration: the engine's knobs (`EngineConfig`) and the model shape read from an HF `config.json` (`ModelConfig`).

This module imports no torch at load time, so the scheduler (which reads `EngineConfig`) stays free of it.
Every `EngineConfig` field carries its command-line help in `metadata["help"]`: the CLI builds its engine flags
from these fields (server/cli/engine_args.py), so a default lives in exactly one place.
"""
from __future__ import annotations

import dataclasses
import enum
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.family_config import FAMILY_FIELDS, Gemma4Attention, MuseGlimmerAttention
from engine.kv.window_pool import DEFAULT_RETENTION_FRACTION

if TYPE_CHECKING:
    import torch

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "deepseek_v2", "deepseek_v3",
                           "deepseek_v32", "deepseek_v4", "qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen3_5_text",
                           "qwen3_5_moe_text", "gemma3", "gemma3_text", "gpt_oss", "glm4_moe_lite", "minimax_m2",
                           "ministral3", "mistral3", "kimi_linear", "gemma4", "gemma4_text", "muse_glimmer",
                           "glm_moe_dsa")
# MLA + MoE with sigmoid scores, a correction bias and grouped top-k: DeepSeek-V3 / V3.2, GLM-4.7-Flash
# (glm4_moe_lite: the same layers, one expert group), Kimi Linear's MLA layers and MoE (kimi_linear) and GLM-5
# (glm_moe_dsa: V3.2's layers)
DEEPSEEK_V3_ROUTING = ("deepseek_v3", "deepseek_v32", "glm4_moe_lite", "kimi_linear", "glm_moe_dsa")
# Checkpoints whose MTP layers follow the last decoder layer (model.layers.{num_hidden_layers}.*): DeepSeek-V3 / R1,
# and V3.2 and GLM-5, whose MTP layer has its own indexer
MTP_AFTER_LAST_LAYER = ("deepseek_v3", "deepseek_v32", "glm_moe_dsa")
# DeepSeek Sparse Attention: MLA over the lightning indexer's top-k (V3.2; GLM-5 with shared layers)
DSA_ARCHITECTURES = ("deepseek_v32", "glm_moe_dsa")
# Hybrid decoders: Gated DeltaNet linear attention (a recurrent state per sequence) between gated full attention.
# qwen3_5 / qwen3_5_moe are the released VLM checkpoints (text_config); the *_text types their language models alone.
HYBRID_ARCHITECTURES = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text")
# Gemma 3: gemma3 is the released VLM checkpoint (text_config; the language model under model.language_model.*),
# gemma3_text its language model alone (Gemma3ForCausalLM: the 270M and 1B checkpoints)
GEMMA3_ARCHITECTURES = ("gemma3", "gemma3_text")
# VLM checkpoints whose language model's shape sits in text_config
# (mistral3: Ministral 3 / Devstral Small 2's released VLM checkpoint, ministral3 its language model)
_TEXT_CONFIG_ARCHITECTURES = ("qwen3_5", "qwen3_5_moe", "gemma3", "mistral3", "gemma4", "muse_glimmer")


class SchedulingPolicy(enum.StrEnum):
    """Order in which waiting requests are admitted."""

    FCFS = "fcfs"  # arrival order
    LONGEST_PREFIX = "longest_prefix"  # the waiting request with the longest cached prefix first


class EvictionPolicy(enum.StrEnum):
    """Which unreferenced cached leaf block is evicted first."""

    LRU = "lru"  # least recently used
    FIFO = "fifo"  # oldest cached


DEFAULT_BLOCK_SIZE = 16


def _help(text: str, **extra: Any) -> dict[str, Any]:
    return {"help": text, **extra}


@dataclass
class EngineConfig:
    block_size: int | None = field(
        default=None, metadata=_help(f"tokens per KV block, a power of two (default: {DEFAULT_BLOCK_SIZE}, or the "
                                     "least the model needs: DeepSeek-V4 keeps its compressed entries per block, so "
                                     "its blocks hold whole pools of its largest compression rate, 128)"))
    num_kv_blocks: int | None = field(
        default=None, metadata=_help("KV blocks in the pool (default: from the memory budget)"))
    kv_cache_memory_gb: float = field(
        default=1.0, metadata=_help("KV cache budget on CPU in GiB, when --num-kv-blocks is not given"))
    gpu_memory_utilization: float = field(
        default=0.9, metadata=_help("fraction of GPU memory for weights + activations + KV cache"))
    max_num_seqs: int = field(default=64, metadata=_help("sequences batched together at most"))
    max_num_batched_tokens: int = field(default=2048, metadata=_help("tokens computed per engine step at most"))
    max_scored_tokens_per_step: int = field(
        default=64, metadata=_help("prompt positions scored (prompt_logprobs: logits over the whole vocabulary for "
                                    "each) per engine step at most: a long prompt's scoring is spread over steps, "
                                    "other requests' tokens between them"))
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
    kv_cache_dtype: str = field(
        default="auto", metadata=_help("KV blocks: auto (the model dtype) or fp8 (e4m3, scale 1.0): twice the tokens "
                                       "of bf16 blocks in the same memory, with a small logprob drift (docs/FP8.md)",
                                       choices=("auto", "fp8")))
    attention_backend: str | None = field(
        default=None, metadata=_help("kernels: torch (the pure-torch reference), cpu (the reference with a native decode-"
                                     "attention kernel that reads the blocks in place) or triton (default: triton on "
                                     "CUDA, cpu elsewhere)", choices=("torch", "cpu", "triton")))
    enforce_eager: bool = field(default=False, metadata=_help("CUDA: run decode batches eagerly, without CUDA graphs"))
    async_scheduling: bool | None = field(
        default=None, metadata=_help("prepare step N+1 on the host while step N runs on the device "
                                     "(default: on for CUDA, off for CPU)"))
    seed: int = field(default=0, metadata=_help("seed of the default random generator (requests without a seed)",
                                                flag="engine-seed", dest="engine_seed"))
    load_format: str = field(
        default="auto", metadata=_help("weights: auto (read the checkpoint) or dummy (random weights of the config's "
                                       "shapes, nothing read: benchmarks)", choices=("auto", "dummy")))
    mxfp4_experts: str = field(
        default="auto", metadata=_help("MXFP4 checkpoints (gpt-oss): auto keeps the experts packed where the Triton "
                                       "kernel runs them (the triton backend) and dequantizes them on load elsewhere; "
                                       "packed keeps them on any backend (the CPU's reference unpacks each expert per "
                                       "call: less memory, slower); dequantized never keeps them (docs/MODELS.md)",
                                       choices=("auto", "packed", "dequantized")))
    tensor_parallel_size: int = field(
        default=1, metadata=_help("shard the model over this many ranks (one process each; GPUs cuda:0..N-1 or, "
                                  "on CPU, gloo): attention heads, MLPs and the vocabulary split N ways"))
    enable_expert_parallel: bool = field(
        default=False, metadata=_help("MoE models under tensor parallelism: each rank holds whole experts (1/N of "
                                      "them) instead of a 1/N slice of every expert"))
    max_retained_fraction: float = field(
        default=0.5, metadata=_help("the largest fraction of the KV pool that retained blocks (cache_control pins, "
                                    "named caches, sessions held across tool calls) may take"))
    max_retained_share_per_tenant: float = field(
        default=0.5, metadata=_help("the largest fraction of the retention cap (--max-retained-fraction) that one "
                                    "API key's retained blocks (its breakpoint pins, session holds and named caches "
                                    "together) may take, so one tenant cannot hold the whole cap; applies when the "
                                    "server has two or more keys (1: no per-tenant bound)"))
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
    language_model_only: bool = field(
        default=False, metadata=_help("a vision-language checkpoint (Qwen3.5 / 3.6) without its vision tower: today's "
                                      "memory and behaviour, and a request carrying images is a 400"))
    encoder_cache_mb: float = field(
        default=256.0, metadata=_help("memory (MiB) for encoded images (the vision tower's outputs), least recently "
                                      "used out first: an image sent again is not encoded again (docs/IMAGES.md)"))
    max_image_tokens_per_step: int | None = field(
        default=None, metadata=_help("image tokens the vision tower encodes per engine step at most, charged against "
                                     "--max-num-batched-tokens, so a request with many images cannot stall the "
                                     "batch (default: that budget; an image larger than it is encoded alone in its "
                                     "step; 0: unbounded, each image encoded whole in the step whose prefill first "
                                     "reaches it)"))
    json_whitespace: int = field(
        default=0, metadata=_help("whitespace characters allowed between the tokens of JSON in constrained output "
                                  "(response_format, tool arguments); 0: compact, json.dumps' one layout (', ' and "
                                  "': '), so that a model cannot spend its budget on blank space"))
    kv_events_endpoint: str | None = field(
        default=None, metadata=_help("publish vLLM-format KV cache events on this ZMQ PUB endpoint, e.g. tcp://*:5557 "
                                     "(docs/ROUTERS.md)"))
    kv_events_replay_endpoint: str | None = field(
        default=None, metadata=_help("ZMQ ROUTER endpoint that replays missed KV event batches, e.g. tcp://*:5558"))
    kv_events_topic: str = field(default="", metadata=_help("topic frame of every KV event message"))
    kv_events_all_interfaces: bool = field(
        default=False, metadata=_help("bind a KV event endpoint's '*' to every network interface (by default '*' "
                                      "means 127.0.0.1: the events carry every tenant's blocks)"))
    kv_events_token_ids: bool = field(
        default=True, metadata=_help("publish each stored block's token ids in the KV events (without them routers "
                                     "still match by block hash, and no prompt text leaves the server)",
                                     flag="no-kv-events-token-ids"))
    state_snapshot_fraction: float = field(
        default=0.2, metadata=_help("hybrid models (Qwen3.5 / 3.6, Qwen3-Next): the share of the KV cache memory, "
                                    "after the running sequences' states, that keeps recurrent-state snapshots for "
                                    "prefix hits; blocks take the rest (docs/HYBRID_CACHE.md)"))
    num_state_snapshots: int | None = field(
        default=None, metadata=_help("hybrid models: recurrent-state snapshots to keep (default: from "
                                     "--state-snapshot-fraction)"))
    sliding_window_cache: bool = field(
        default=True, metadata=_help("sliding-window models (Gemma 3, gpt-oss, DeepSeek V4's keys): their window "
                                     "layers keep only the pages their windows read, in a pool of their own, and the "
                                     "prefix cache retains windows where requests resume (docs/SLIDING_WINDOW.md); "
                                     "off: every layer keeps every token", flag="no-sliding-window-cache"))
    window_retention_fraction: float = field(
        default=DEFAULT_RETENTION_FRACTION,
        metadata=_help("sliding-window models: the share of the KV cache memory, after the running sequences' windows, "
                       "that keeps windows for prefix hits (retained and cached ones); full-attention blocks take the "
                       "rest"))
    num_window_blocks: int | None = field(
        default=None, metadata=_help("sliding-window models: pages of the window layers (default: the running "
                                     "sequences' windows plus --window-retention-fraction)"))
    speculative: str = field(
        default="off", metadata=_help("speculative decoding: off, ngram (prompt lookup: drafts from the request's own "
                                      "tokens), suffix (a suffix tree over the session's earlier prompts and "
                                      "replies, then prompt lookup) or mtp (the checkpoint's own multi-token-"
                                      "prediction layer: Qwen3.5 / 3.6; loaded only with this flag); a request may "
                                      "choose its own (docs/SPECULATIVE.md)",
                                      choices=("off", "ngram", "suffix", "mtp")))
    num_speculative_tokens: int = field(
        default=4, metadata=_help("speculative decoding: draft tokens verified per step and sequence at most"))
    speculative_draft_budget: int = field(
        default=16, metadata=_help("speculative decoding: draft tokens per step for the whole batch, so speculation "
                                   "turns itself down as the batch grows (each sequence drafts min(k, budget / "
                                   "decoding sequences))"))

    def __post_init__(self) -> None:
        if self.block_size is not None and (self.block_size < 1 or self.block_size & (self.block_size - 1)):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be positive, got {self.num_kv_blocks}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.max_scored_tokens_per_step < 1:
            raise ValueError("max_num_seqs, max_num_batched_tokens and max_scored_tokens_per_step must be positive")
        if not 0 <= self.max_retained_fraction <= 1:
            raise ValueError(f"max_retained_fraction must be in [0, 1], got {self.max_retained_fraction}")
        if not 0 < self.max_retained_share_per_tenant <= 1:
            raise ValueError("max_retained_share_per_tenant must be in (0, 1], got "
                             f"{self.max_retained_share_per_tenant}")
        if not 0 <= self.state_snapshot_fraction < 1:
            raise ValueError(f"state_snapshot_fraction must be in [0, 1), got {self.state_snapshot_fraction}")
        if not 0 <= self.window_retention_fraction < 1:
            raise ValueError(f"window_retention_fraction must be in [0, 1), got {self.window_retention_fraction}")
        if self.num_state_snapshots is not None and self.num_state_snapshots < 0:
            raise ValueError(f"num_state_snapshots must be >= 0, got {self.num_state_snapshots}")
        if self.encoder_cache_mb < 0:
            raise ValueError(f"encoder_cache_mb must be >= 0, got {self.encoder_cache_mb}")
        if self.max_image_tokens_per_step is not None and self.max_image_tokens_per_step < 0:
            raise ValueError(f"max_image_tokens_per_step must be >= 0, got {self.max_image_tokens_per_step}")
        if self.tool_call_ttl < 0 or self.kv_offload_gb < 0 or self.kv_disk_gb <= 0:
            raise ValueError("tool_call_ttl and kv_offload_gb must be >= 0, kv_disk_gb > 0")
        if self.json_whitespace < 0:
            raise ValueError(f"json_whitespace must be >= 0, got {self.json_whitespace}")
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
            self.attention_backend = "triton" if on_cuda else "cpu"
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8', got {self.kv_cache_dtype!r}")
        if self.mxfp4_experts not in ("auto", "packed", "dequantized"):
            raise ValueError(f"mxfp4_experts must be 'auto', 'packed' or 'dequantized', got {self.mxfp4_experts!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.attention_backend not in ("torch", "cpu", "triton"):
            raise ValueError(f"attention_backend must be 'torch', 'cpu' or 'triton', got {self.attention_backend!r}")
        if self.async_scheduling is None:
            self.async_scheduling = on_cuda
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}")
        if self.speculative not in ("off", "ngram", "suffix", "mtp"):
            raise ValueError(f"speculative must be 'off', 'ngram', 'suffix' or 'mtp', got {self.speculative!r}")
        if self.num_speculative_tokens < 1 or self.speculative_draft_budget < 0:
            raise ValueError("num_speculative_tokens must be >= 1 and speculative_draft_budget >= 0")
        if self.tensor_parallel_size > 1 and self.kv_disk_dir:  # each rank would need its own files, kept in step
            raise ValueError("the disk KV tier (kv_disk_dir) does not work with tensor_parallel_size > 1 yet; "
                             "use the host tier (kv_offload_gb) alone")

    @property
    def torch_dtype(self) -> "torch.dtype":
        import torch

        dtype = getattr(torch, self.dtype or "", None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {self.dtype!r}; use float32, bfloat16 or float16")
        return dtype

    @property
    def kv_cache_torch_dtype(self) -> "torch.dtype":
        import torch

        return torch.float8_e4m3fn if self.kv_cache_dtype == "fp8" else self.torch_dtype


def _enum_value(kind: type[enum.Enum], value: Any, name: str) -> Any:
    try:
        return kind(value)
    except ValueError:
        valid = ", ".join(repr(m.value) for m in kind)
        raise ValueError(f"{name} must be one of {valid}, got {value!r}") from None


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts MLP: which layers have one, how the router picks experts, and their sizes.

    Qwen3-MoE: softmax over all experts, top-k, optionally renormalized. DeepSeek-V3: sigmoid scores, a per-expert
    correction bias that only steers the choice, top-k within the best ``topk_group`` of ``n_group`` groups, the
    chosen scores renormalized and scaled. DeepSeek-V2: softmax, greedy or group-limited (by group maximum) top-k.
    """

    num_experts: int
    top_k: int
    intermediate_size: int  # per expert
    moe_layers: tuple[int, ...]  # indices of the layers whose MLP is the MoE (the others are dense)
    norm_topk_prob: bool
    scoring: str = "softmax"  # or "sigmoid", or "sqrtsoftplus" (DeepSeek-V4)
    num_shared_experts: int = 0  # always-on experts added to the routed ones (DeepSeek)
    n_group: int = 1
    topk_group: int = 1
    group_score: str = "top2_sum"  # how a group is ranked: "top2_sum" (V3) or "max" (V2 group_limited_greedy)
    correction_bias: bool = False  # DeepSeek-V3's e_score_correction_bias
    routed_scaling_factor: float = 1.0
    hash_layers: tuple[int, ...] = ()  # DeepSeek-V4: layers routing by a fixed token -> experts table (tid2eid)
    swiglu_limit: float | None = None  # DeepSeek-V4: gate clamped to <= limit, up to [-limit, limit]
    # gpt-oss: the router and every expert projection carry a bias, and the experts' activation is
    # (up + 1) * gate * sigmoid(swiglu_alpha * gate) on the clamped inputs
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_alpha: float | None = None

    @classmethod
    def _deepseek_v4(cls, cfg: dict[str, Any], num_experts: int) -> "MoEConfig":
        """Every layer is an MoE: the first ``num_hash_layers`` route by a fixed token -> experts table, the rest
        by sqrt(softplus) scores with a correction bias, renormalized and scaled; SwiGLU inputs clamped."""
        num_layers = cfg["num_hidden_layers"]
        kinds = cfg.get("mlp_layer_types") or (
            ["hash_moe"] * cfg.get("num_hash_layers", 3) + ["moe"] * num_layers)[:num_layers]
        return cls(
            num_experts=num_experts, top_k=cfg["num_experts_per_tok"], intermediate_size=cfg["moe_intermediate_size"],
            moe_layers=tuple(range(num_layers)), norm_topk_prob=True, scoring=cfg.get("scoring_func", "sqrtsoftplus"),
            num_shared_experts=cfg.get("n_shared_experts") or 0, correction_bias=True,
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            hash_layers=tuple(i for i, kind in enumerate(kinds) if kind == "hash_moe"),
            swiglu_limit=cfg.get("swiglu_limit"),
        )
    gated_shared_expert: int = 0  # Qwen3-Next / 3.5: width of one shared expert scaled by sigmoid(shared_expert_gate)

    @classmethod
    def from_dict(cls, arch: str, cfg: dict[str, Any]) -> "MoEConfig | None":
        num_layers = cfg["num_hidden_layers"]
        # transformers 5 writes the expert count as num_local_experts; checkpoints have num_experts / n_routed_experts
        num_experts = cfg.get("num_experts") or cfg.get("n_routed_experts") or cfg.get("num_local_experts")
        if arch == "deepseek_v4":
            return cls._deepseek_v4(cfg, num_experts)
        if arch == "minimax_m2":  # every layer an MoE: sigmoid scores, a bias steering the top-k, renormalized
            return cls(num_experts=num_experts, top_k=cfg["num_experts_per_tok"],
                       intermediate_size=cfg["intermediate_size"], moe_layers=tuple(range(num_layers)),
                       norm_topk_prob=True, scoring="sigmoid", correction_bias=True)
        if arch == "gpt_oss":  # every layer an MoE: top-k of the router's logits, softmaxed over the k chosen
            return cls(num_experts=num_experts, top_k=cfg["num_experts_per_tok"],
                       intermediate_size=cfg["intermediate_size"], moe_layers=tuple(range(num_layers)),
                       norm_topk_prob=False, scoring="topk_softmax", router_bias=True, expert_bias=True,
                       swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
                       swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)))
        if arch == "qwen3_moe" or arch in HYBRID_ARCHITECTURES:  # Qwen's layout; the hybrids add a gated shared expert
            hybrid = arch in HYBRID_ARCHITECTURES
            step, dense = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or [])
            layers = [i for i in range(num_layers) if i not in dense and (i + 1) % step == 0]
            if not num_experts or not layers:
                return None
            return cls(
                num_experts=num_experts, top_k=cfg["num_experts_per_tok"],
                intermediate_size=cfg["moe_intermediate_size"], moe_layers=tuple(layers),
                norm_topk_prob=cfg.get("norm_topk_prob", hybrid),
                gated_shared_expert=(cfg.get("shared_expert_intermediate_size") or 0) if hybrid else 0,
            )
        if arch != "deepseek_v2" and arch not in DEEPSEEK_V3_ROUTING:
            return None
        first, freq = cfg.get("first_k_dense_replace", 0), cfg.get("moe_layer_freq", 1)
        layers = [i for i in range(first, num_layers) if i % freq == 0]
        if cfg.get("mlp_layer_types"):  # transformers 5 writes the schedule out (DeepSeek-V3.2)
            layers = [i for i, kind in enumerate(cfg["mlp_layer_types"]) if kind == "sparse"]
        if not num_experts or not layers:
            return None
        v3 = arch in DEEPSEEK_V3_ROUTING
        method = cfg.get("topk_method", "noaux_tc" if v3 else "greedy")
        grouped = method in ("noaux_tc", "group_limited_greedy")
        scoring = cfg.get("scoring_func", "sigmoid" if v3 else "softmax")
        if scoring not in ("softmax", "sigmoid") or method not in ("greedy", "group_limited_greedy", "noaux_tc"):
            raise ValueError(f"MoE routing {scoring!r} / {method!r} is not supported")
        return cls(
            num_experts=num_experts, top_k=cfg["num_experts_per_tok"],
            intermediate_size=cfg["moe_intermediate_size"], moe_layers=tuple(layers),
            # DeepSeek-V2 never renormalizes (transformers' router ignores norm_topk_prob; the released V2 checkpoints
            # set it false, and their original code renormalized only above one expert)
            norm_topk_prob=v3 and bool(cfg.get("norm_topk_prob", True)), scoring=scoring,
            num_shared_experts=cfg.get("n_shared_experts") or 0,
            n_group=(cfg.get("n_group") or 1) if grouped else 1,
            topk_group=(cfg.get("topk_group") or 1) if grouped else 1,
            group_score="top2_sum" if method == "noaux_tc" else "max",
            correction_bias=method == "noaux_tc",
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        )


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): keys and values are decompressed per head from one latent of
    ``kv_lora_rank`` values per token, next to a rotary key of ``qk_rope_head_dim`` shared by all heads."""

    q_lora_rank: int | None  # None: queries come from one projection (q_proj), else q_a_proj -> norm -> q_b_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # the rotary dims are (x0, x1), (x2, x3), ... pairs as in DeepSeek's checkpoints
    rope: bool = True  # False: no RoPE at all, the "rotary" key part is shared by the heads as is (Kimi Linear)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "MLAConfig":
        return cls(
            q_lora_rank=cfg.get("q_lora_rank"),
            kv_lora_rank=cfg["kv_lora_rank"],
            qk_nope_head_dim=cfg["qk_nope_head_dim"],
            qk_rope_head_dim=cfg["qk_rope_head_dim"],
            v_head_dim=cfg["v_head_dim"],
            rope_interleave=cfg.get("rope_interleave", True),
            rope=not cfg.get("mla_use_nope", False),
        )


@dataclass(frozen=True)
class IndexerConfig:
    """DeepSeek-V3.2's lightning indexer (DeepSeek Sparse Attention): ``num_heads`` index queries of ``head_dim``
    per token from the q-LoRA latent, one index key of ``head_dim`` per token (cached beside the MLA latent), and
    the ``topk`` best-scored context tokens each query attends to."""

    num_heads: int
    head_dim: int
    topk: int
    rope_interleaved: bool = False  # GLM-5 rotates the index keys' (x0, x1), (x2, x3) pairs; V3.2 neox-style halves
    shared: tuple[bool, ...] = ()  # per layer: reuse the previous indexed layer's choice (GLM-5's "shared" layers)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "IndexerConfig":
        glm5 = cfg.get("model_type") == "glm_moe_dsa"
        return cls(num_heads=cfg["index_n_heads"], head_dim=cfg["index_head_dim"], topk=cfg["index_topk"],
                   rope_interleaved=glm5, shared=_shared_index_layers(cfg) if glm5 else ())

    def is_shared(self, layer: int) -> bool:
        return layer < len(self.shared) and self.shared[layer]


def _shared_index_layers(cfg: dict[str, Any]) -> tuple[bool, ...]:
    """GLM-5's ``indexer_types`` ("full" runs the layer's indexer, "shared" reuses the last full layer's top-k), as
    transformers derives it when a config carries only ``index_topk_pattern`` or ``index_topk_freq`` /
    ``index_skip_topk_offset``."""
    kinds = cfg.get("indexer_types")
    if kinds is None and (pattern := cfg.get("index_topk_pattern")) is not None:
        kinds = [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
    if kinds is None:
        freq, offset = max(cfg.get("index_topk_freq", 1), 1), cfg.get("index_skip_topk_offset", 2)
        kinds = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(cfg["num_hidden_layers"])]
    if kinds and kinds[0] == "shared":
        raise ValueError("GLM-5's indexer_types: the first layer must be 'full' (a shared layer reuses an earlier one)")
    return tuple(kind == "shared" for kind in kinds)


V4_LAYER_TYPES = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}


@dataclass(frozen=True)
class V4Config:
    """DeepSeek-V4's attention and residual stream, from its config.json (transformers' keys and the checkpoints'
    older ones: compress_ratios, num_hash_layers, qk_rope_head_dim, flat rope_scaling).

    Every layer attends to a ``sliding_window`` of its single K = V head, plus, by layer, nothing more (rate 0),
    compressed entries pooled from overlapping windows of ``2 x csa_rate`` tokens every ``csa_rate`` tokens and
    chosen by a lightning indexer (``index_topk`` of them), or every entry pooled from ``hca_rate`` tokens."""

    head_dim: int
    rope_dim: int  # the last rope_dim of each head are rotary (interleaved pairs)
    q_lora_rank: int
    sliding_window: int
    compress_rates: tuple[int, ...]  # per layer: 0, csa_rate or hca_rate
    csa_rate: int
    hca_rate: int
    o_groups: int
    o_lora_rank: int
    index_num_heads: int
    index_head_dim: int
    index_topk: int
    compress_rope_theta: float
    compress_rope_scaling: dict[str, Any]  # YaRN of the compressed layers (sliding-only layers: plain RoPE)
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float

    @property
    def block_multiple(self) -> int:
        """A block holds whole pools of every compressed layer (their entries and pooling state live per block)."""
        return math.lcm(1, *(rate for rate in self.compress_rates if rate))

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "V4Config":
        rates = dict(cfg.get("compress_rates") or {})
        csa = rates.get("compressed_sparse_attention", cfg.get("compress_rate_csa", 4))
        hca = rates.get("heavily_compressed_attention", cfg.get("compress_rate_hca", 128))
        rate_of = {"sliding_attention": 0, "compressed_sparse_attention": csa, "heavily_compressed_attention": hca}
        num_layers = cfg["num_hidden_layers"]
        if cfg.get("layer_types"):
            layer_rates = [rate_of[kind] for kind in cfg["layer_types"]]
        elif cfg.get("compress_ratios"):  # older checkpoints: 0 / 4 / 128 per layer
            layer_rates = [rate_of[V4_LAYER_TYPES[r]] for r in cfg["compress_ratios"]]
        else:  # transformers' default: two HCA layers, then CSA and HCA alternating
            layer_rates = [hca] * min(num_layers, 2) + [csa if i % 2 else hca for i in range(max(num_layers - 2, 0))]
        head_dim = cfg["head_dim"]
        rope_dim = cfg.get("qk_rope_head_dim") or int(head_dim * (cfg.get("partial_rotary_factor") or 64 / 512))
        rope = cfg.get("rope_parameters") or {}
        theta = float(cfg.get("compress_rope_theta", 160000.0))
        if isinstance(rope.get("compress"), dict):  # transformers' layout: per rope type
            scaling = dict(rope["compress"])
            theta = float(scaling.get("rope_theta", theta))
        else:  # a flat YaRN of the compressed layers: their theta is compress_rope_theta, whatever it says
            scaling = {k: v for k, v in (cfg.get("rope_scaling") or rope).items() if k not in ("main", "compress")}
        scaling.pop("rope_theta", None)
        scaling.pop("partial_rotary_factor", None)
        if scaling.get("rope_type", scaling.get("type", "default")) == "default":
            scaling = {}
        else:  # V4 leaves cos/sin unscaled by YaRN's magnitude factor
            scaling.setdefault("attention_factor", 1.0)
            scaling.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings", 2048))
        return cls(
            head_dim=head_dim, rope_dim=rope_dim, q_lora_rank=cfg["q_lora_rank"],
            sliding_window=cfg.get("sliding_window", 128), compress_rates=tuple(layer_rates[:num_layers]),
            csa_rate=csa, hca_rate=hca, o_groups=cfg["o_groups"], o_lora_rank=cfg["o_lora_rank"],
            index_num_heads=cfg["index_n_heads"], index_head_dim=cfg["index_head_dim"], index_topk=cfg["index_topk"],
            compress_rope_theta=theta, compress_rope_scaling=scaling, hc_mult=cfg.get("hc_mult", 4),
            hc_sinkhorn_iters=cfg.get("hc_sinkhorn_iters", 20), hc_eps=cfg.get("hc_eps", 1e-6),
        )

@dataclass(frozen=True)
class LinearAttentionConfig:
    """Gated DeltaNet layers of a hybrid model (Qwen3-Next, Qwen3.5 / 3.6): which layers they are and their sizes.

    Each keeps a recurrent state per sequence instead of K/V blocks: a conv window of the last ``conv_kernel - 1``
    projected inputs and a ``[value_heads, key_head_dim, value_head_dim]`` fp32 delta-rule state."""

    layer_types: tuple[str, ...]  # per layer: "linear_attention" or "full_attention"
    conv_kernel: int
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    grouped_projections: bool  # Qwen3-Next: in_proj_qkvz / in_proj_ba interleaved per key head (3.5: separate)
    channel_gate: bool = False  # Kimi Delta Attention: a decay per key channel, not one per head

    @classmethod
    def from_dict(cls, arch: str, cfg: dict[str, Any]) -> "LinearAttentionConfig":
        num_layers = cfg["num_hidden_layers"]
        types = cfg.get("layer_types") or [
            "full_attention" if (i + 1) % cfg.get("full_attention_interval", 4) == 0 else "linear_attention"
            for i in range(num_layers)]
        return cls(
            layer_types=tuple(types), conv_kernel=cfg.get("linear_conv_kernel_dim", 4),
            num_key_heads=cfg["linear_num_key_heads"], num_value_heads=cfg["linear_num_value_heads"],
            key_head_dim=cfg["linear_key_head_dim"], value_head_dim=cfg["linear_value_head_dim"],
            grouped_projections=arch == "qwen3_next", channel_gate=arch == "kimi_linear",
        )

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels through the causal conv: q, k and v of every head."""
        return 2 * self.key_dim + self.value_dim

    def is_linear(self, layer: int) -> bool:
        return self.layer_types[layer] == "linear_attention"


@dataclass(frozen=True)
class SlidingWindowConfig:
    """Layers that attend to a sliding window (Gemma 3's local layers) beside full-attention ones: a query at position
    p sees keys in ``(p - window, p]``, as transformers' ``sliding_window``. Their RoPE has its own base (Gemma 3:
    ``rope_local_base_freq``, or ``rope_parameters["sliding_attention"]`` in transformers 5's configs)."""

    window: int
    layer_types: tuple[str, ...]  # per layer: "sliding_attention" or "full_attention"
    rope_theta: float
    rope_scaling: dict[str, Any] = field(default_factory=dict)

    def layer_window(self, layer: int) -> int | None:
        """Layer ``layer``'s window, None for full attention."""
        return self.window if self.layer_types[layer] == "sliding_attention" else None

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], default_pattern: int = 6) -> "SlidingWindowConfig":
        num_layers = cfg["num_hidden_layers"]
        pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or default_pattern
        types = cfg.get("layer_types") or [  # transformers' default: every pattern-th layer is global
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)]
        unknown = set(types) - {"sliding_attention", "full_attention"}
        if unknown:
            raise ValueError(f"layer types {sorted(unknown)} are not supported (sliding_attention, full_attention are)")
        local = dict((cfg.get("rope_parameters") or {}).get("sliding_attention") or {})
        theta = float(local.pop("rope_theta", cfg.get("rope_local_base_freq", 10000.0)))
        return cls(window=cfg.get("sliding_window") or 4096, layer_types=tuple(types[:num_layers]), rope_theta=theta,
                   rope_scaling=_rope_scaling(local, cfg))


def _rope_scaling(rope: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """A RoPE scaling dict as `engine.models.layers.rope` reads it: empty for plain RoPE; else with the trained length."""
    rope = {k: v for k, v in rope.items() if k not in ("rope_theta", "partial_rotary_factor")}
    if rope.get("rope_type", rope.get("type", "default")) == "default":
        return {}
    rope.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings", 2048))
    return rope


def _gpt_oss_sliding(cfg: dict[str, Any], rope_theta: float, rope: dict[str, Any]) -> SlidingWindowConfig:
    """gpt-oss' window layers (the even ones by default; ``layer_types`` in its configs), with the full layers' RoPE."""
    sliding = SlidingWindowConfig.from_dict({**cfg, "sliding_window": cfg.get("sliding_window") or 128},
                                            default_pattern=2)
    return dataclasses.replace(sliding, rope_theta=rope_theta, rope_scaling=rope)


def _kimi_linear(cfg: dict[str, Any]) -> dict[str, Any]:
    """Kimi Linear's config.json in the keys the other families use (as transformers' KimiLinearConfig reads it):
    the released checkpoints' ``linear_attn_config`` (1-indexed full-attention and KDA layers, heads, the conv
    kernel) and their MoE names; MLA without RoPE whatever ``mla_use_nope`` says, as transformers runs it."""
    linear = cfg.get("linear_attn_config") or {}
    num_layers = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if not types and "full_attn_layers" in linear:
        full = set(linear["full_attn_layers"])
        types = ["full_attention" if i + 1 in full else "linear_attention" for i in range(num_layers)]
    heads, head_dim = linear.get("num_heads", cfg.get("linear_num_heads")), linear.get("head_dim",
                                                                                          cfg.get("linear_head_dim"))
    aliases = {"n_routed_experts": "num_experts", "num_experts_per_tok": "num_experts_per_token",
               "norm_topk_prob": "moe_renormalize", "n_group": "num_expert_group",
               "n_shared_experts": "num_shared_experts", "max_position_embeddings": "model_max_length"}
    return {**cfg, **{k: cfg[alias] for k, alias in aliases.items() if alias in cfg and k not in cfg},
            "layer_types": types or ["full_attention" if i and i % 4 == 0 else "linear_attention"
                                     for i in range(num_layers)],
            "linear_num_key_heads": heads, "linear_num_value_heads": heads, "linear_key_head_dim": head_dim,
            "linear_value_head_dim": head_dim,
            "linear_conv_kernel_dim": linear.get("short_conv_kernel_size", cfg.get("linear_conv_kernel_dim", 4)),
            "first_k_dense_replace": cfg.get("first_k_dense_replace", 1), "mla_use_nope": True}


def _gemma3_text(cfg: dict[str, Any]) -> dict[str, Any]:
    """A Gemma 3 config with its global layers' RoPE where every other model has it (transformers 5 keys RoPE by
    layer type; older configs have rope_theta for the global layers and rope_local_base_freq for the local ones),
    after refusing what kvserve does not run."""
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("Gemma 3 with bidirectional attention (an embedding model) is not a decoder kvserve runs")
    if cfg.get("attn_logit_softcapping") is not None:
        raise ValueError("attention logit softcapping (attn_logit_softcapping) is not supported")
    rope = cfg.get("rope_parameters") or {}
    if "full_attention" in rope or "sliding_attention" in rope:
        return {**cfg, "rope_parameters": dict(rope.get("full_attention") or {"rope_theta": 1_000_000.0})}
    return {**cfg, "rope_theta": cfg.get("rope_theta", 1_000_000.0)}


@dataclass
class ModelConfig:
    """The decoder's shape, from an HF config.json: Llama / Qwen2 / Qwen3 (dense), Qwen3-MoE, DeepSeek-V2/V3/V3.2."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # of the dense MLPs
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
    moe: MoEConfig | None = None
    mla: MLAConfig | None = None
    indexer: IndexerConfig | None = None  # DeepSeek-V3.2's sparse attention
    v4: V4Config | None = None  # DeepSeek-V4's attention and hyper-connections
    linear: LinearAttentionConfig | None = None  # hybrid models' Gated DeltaNet layers
    partial_rotary_factor: float = 1.0  # RoPE turns the first head_dim * this dims of each head (Qwen3-Next: 0.25)
    attn_output_gate: bool = False  # q_proj also gives a per-head gate: attention output * sigmoid(gate)
    zero_centered_norms: bool = False  # RMSNorm weights w apply as (1 + w) (Qwen3-Next / 3.5)
    has_vision_tower: bool = False  # a VLM checkpoint: its tower runs where kvserve has it (engine/models/vision/)
    num_mtp_layers: int = 0  # multi-token-prediction layers the checkpoint carries (engine/models/mtp.py)
    sliding: SlidingWindowConfig | None = None  # sliding-window layers beside full ones (Gemma 3)
    query_pre_attn_scalar: float | None = None  # the softmax scale is its -1/2 power (Gemma 3); None: head_dim's
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    attention_sinks: bool = False  # a learned sink logit per attention head (gpt-oss)
    qk_norm_across_heads: bool = False  # MiniMax-M2: q and k each RMS-normalized over all their heads at once
    o_proj_bias: bool = False  # the attention output projection carries a bias (gpt-oss)
    hidden_act: str = "silu"  # the gated MLP's activation: silu, or gelu_pytorch_tanh (Gemma)
    # Ministral 3 (Llama 4's attention temperature): queries times 1 + beta * log(1 + floor(position / length))
    query_scale_beta: float | None = None
    query_scale_length: int = 1
    gemma4: Gemma4Attention | None = None  # Gemma 4's global layers' shape (engine/family_config.py)
    muse_glimmer: MuseGlimmerAttention | None = None  # Muse-Glimmer's attention scalars and NoPE layers

    def layer_window(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding window, None for full attention."""
        return None if self.sliding is None else self.sliding.layer_window(layer)

    @property
    def is_hybrid(self) -> bool:
        return self.linear is not None

    @property
    def block_multiple(self) -> int:
        """The block size must be a multiple of this (1: any power of two)."""
        return self.v4.block_multiple if self.v4 is not None else 1

    def choose_block_size(self, requested: int | None) -> int:
        """``requested``, or the default block size raised to the least multiple this model needs."""
        if requested is not None:
            return requested
        size = math.lcm(DEFAULT_BLOCK_SIZE, self.block_multiple)
        if size & (size - 1):
            raise ValueError(f"this model needs blocks of a multiple of {self.block_multiple} tokens, which no power of "
                             "two is")
        return size

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        arch = cfg.get("model_type", "")
        vision, text_model = False, None
        if arch in _TEXT_CONFIG_ARCHITECTURES and "text_config" in cfg:
            text_model = cfg["text_config"].get("model_type")
            # The released VLM layout: the language model's shape sits in text_config (ids may sit outside it).
            # (Devstral Small 2's Pixtral tower is not one kvserve runs: its language model serves text only)
            vision = cfg.get("vision_config") is not None and arch != "mistral3"
            cfg = {**{k: v for k, v in cfg.items() if k != "text_config"}, **cfg["text_config"], "model_type": arch}
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"model_type {arch!r} is not supported; kvserve runs {', '.join(SUPPORTED_ARCHITECTURES)} decoders"
            )
        gemma3, gpt_oss = arch in GEMMA3_ARCHITECTURES, arch == "gpt_oss"
        if gemma3:
            cfg = _gemma3_text(cfg)
        if arch == "kimi_linear":
            cfg = _kimi_linear(cfg)
        num_heads = cfg["num_attention_heads"]
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        # mRoPE's sections only matter for image positions; text positions are equal in all three, i.e. plain RoPE.
        for key in ("mrope_section", "mrope_interleaved"):
            rope.pop(key, None)
        query_scale_beta = rope.pop("llama_4_scaling_beta", None)  # Ministral 3's: not a RoPE parameter
        if text_model not in ("ministral3", None):  # a Mistral3 VLM around a plain Mistral (Mistral Small 3.1)
            query_scale_beta = None
        rope.pop("max_position_embeddings", None)
        hybrid = arch in HYBRID_ARCHITECTURES
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        # MiniMax-M2's checkpoints say how many dims of a head turn as rotary_dim
        default_rotary = 0.25 if hybrid else cfg.get("rotary_dim", head_dim) / head_dim if arch == "minimax_m2" else 1.0
        partial_rotary = float(rope.pop("partial_rotary_factor", cfg.get("partial_rotary_factor", default_rotary)))
        if rope.get("rope_type", rope.get("type", "default")) == "default":
            rope = {}
        elif "original_max_position_embeddings" not in rope:  # as transformers: the trained length
            rope["original_max_position_embeddings"] = cfg.get("max_position_embeddings", 2048)
        eos = cfg.get("eos_token_id")
        model = cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg.get("intermediate_size") or cfg["moe_intermediate_size"],  # V4, 3.5-MoE: only experts
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", gemma3),
            attention_bias=cfg.get("attention_bias", arch == "qwen2"),
            qk_norm=arch in ("qwen3", "qwen3_moe") or hybrid or gemma3,
            qk_norm_across_heads=arch == "minimax_m2",
            rope_theta=rope_theta,
            rope_scaling=rope,
            eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
            moe=MoEConfig.from_dict(arch, cfg),
            mla=MLAConfig.from_dict(cfg) if arch in ("deepseek_v2", *DEEPSEEK_V3_ROUTING) else None,
            indexer=IndexerConfig.from_dict(cfg) if arch in DSA_ARCHITECTURES else None,
            v4=V4Config.from_dict(cfg) if arch == "deepseek_v4" else None,
            linear=LinearAttentionConfig.from_dict(arch, cfg) if hybrid or arch == "kimi_linear" else None,
            partial_rotary_factor=partial_rotary,
            attn_output_gate=hybrid,
            zero_centered_norms=hybrid or gemma3,
            has_vision_tower=vision,
            # Qwen3.5 / 3.6 name the count mtp_num_hidden_layers, Qwen3-Next num_nextn_predict_layers (both: mtp.*),
            # DeepSeek-V3 num_nextn_predict_layers (layers after the last: model.layers.{num_hidden_layers}.*)
            num_mtp_layers=(cfg.get("mtp_num_hidden_layers") or cfg.get("num_nextn_predict_layers") or 0)
            if hybrid or arch in MTP_AFTER_LAST_LAYER else 0,
            sliding=SlidingWindowConfig.from_dict(cfg) if gemma3 else _gpt_oss_sliding(cfg, rope_theta, rope)
            if gpt_oss else None,
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar", 256) if gemma3 else None,
            final_logit_softcapping=cfg.get("final_logit_softcapping") if gemma3 else None,
            attention_sinks=gpt_oss,
            o_proj_bias=gpt_oss and cfg.get("attention_bias", True),
            hidden_act=cfg.get("hidden_activation") or "gelu_pytorch_tanh" if gemma3 else "silu",
            query_scale_beta=query_scale_beta,
            query_scale_length=int(rope.get("original_max_position_embeddings") or 1),
        )
        if arch not in FAMILY_FIELDS:
            return model
        fields = FAMILY_FIELDS[arch](cfg)  # Gemma 4, Muse-Glimmer: their keys read apart
        return dataclasses.replace(model, sliding=SlidingWindowConfig(**fields.pop("sliding_window")), **fields)

    @classmethod
    def from_dir(cls, model_dir: Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.exists():
            raise ValueError(f"{model_dir} has no config.json; is it an HF-format model directory?")
        cfg = cls.from_dict(json.loads(path.read_text()))
        if cfg.tie_word_embeddings and _holds_head(Path(model_dir)):
            # As transformers: a checkpoint that saved a head of its own is not tied, whatever config.json says
            # (a VLM's text_config may say tied while the model, by its top-level config, is not).
            cfg = dataclasses.replace(cfg, tie_word_embeddings=False)
        return cfg


def _holds_head(model_dir: Path) -> bool:
    """Whether the safetensors checkpoint in ``model_dir`` has an output head of its own (``lm_head.weight``, or a
    VLM's ``language_model.lm_head.weight``), read from the index or the file headers: no tensor data, no torch."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        names = json.loads(index.read_text())["weight_map"]
    else:
        names = []
        for path in model_dir.glob("*.safetensors"):
            with path.open("rb") as f:
                names += json.loads(f.read(int.from_bytes(f.read(8), "little")))
    return any(name == "lm_head.weight" or name.endswith(".lm_head.weight") for name in names)
