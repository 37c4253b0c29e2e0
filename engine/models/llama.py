"""One decoder for the Llama family: Llama, Mistral-style, Qwen2 (QKV bias), Qwen3 (q/k RMSNorm) and Qwen3-MoE
(Qwen3 with mixture-of-experts MLPs, `engine.models.moe`). DeepSeek-V2/V3 reuse its loop with MLA attention.

Inputs are the flattened batch (all sequences' new tokens in one row dimension); attention reads and writes the
paged KV cache through the ops chosen in `kernels.ops`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.config import ModelConfig
from engine.kv_cache_spec import KVCacheSpec, KVCaches
from engine.models.moe import make_mlp
from engine.models.rope import build_cos_sin_cache
from kernels.ops import Ops


@dataclass
class AttentionMetadata:
    """Where this step's tokens live in the pages; shapes as in `kernels.reference`.

    ``max_query_len`` / ``max_context_len`` are host-side upper bounds (the runner knows them from its Python lists)
    so the attention kernel sizes its launch without a device-to-host copy per layer; under CUDA-graph capture they
    are the fixed bounds every replay stays within.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int
    max_context_len: int


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.head_dim**-0.5

    def forward(
        self,
        ops: Ops,
        x: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = ops.rms_norm(q, self.q_norm.weight, self.q_norm.eps)
            k = ops.rms_norm(k, self.k_norm.weight, self.k_norm.eps)
        q, k = ops.rotary_embedding(positions, q, k, cos_sin)
        k_cache, v_cache = kv_cache
        ops.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = ops.paged_attention(
            q, k_cache, v_cache, meta.block_tables, meta.context_lens, meta.query_start_loc, self.scale,
            max_query_len=meta.max_query_len, max_context_len=meta.max_context_len,
        )
        return self.o_proj(out.reshape(-1, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, attention_class: type[nn.Module]) -> None:
        super().__init__()
        self.self_attn = attention_class(cfg)
        self.mlp = make_mlp(cfg, layer_idx)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Parameter names follow HF checkpoints, except the fused ``qkv_proj`` and ``gate_up_proj`` (see weights.py)."""

    attention_class: type[nn.Module] = Attention

    def __init__(self, cfg: ModelConfig, ops: Ops) -> None:
        super().__init__()
        self.cfg = cfg
        self.ops = ops
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, self.attention_class) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.cos_sin_cache: torch.Tensor | None = None  # set by init_rope, after the weights have a device

    def tie_weights(self) -> None:
        """Share the embedding with the output head (tied checkpoints); redo after moving off the meta device."""
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @property
    def rope_dim(self) -> int:
        return self.cfg.head_dim

    def kv_cache_spec(self) -> KVCacheSpec:
        return KVCacheSpec.gqa(self.cfg.num_layers, self.cfg.num_kv_heads, self.cfg.head_dim)

    def init_rope(self, max_positions: int, device: torch.device) -> None:
        cfg = self.cfg
        cache = build_cos_sin_cache(self.rope_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.cos_sin_cache = cache.to(device)  # float32 whatever the model dtype: RoPE is computed in fp32

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: KVCaches,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` after the final norm, for every input token."""
        ops = self.ops
        x = self.embed_tokens(input_ids)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            norm = layer.input_layernorm
            if residual is None:
                residual = x
                h = ops.rms_norm(x, norm.weight, norm.eps)
            else:
                h, residual = ops.rms_norm(x, norm.weight, norm.eps, residual)
            h = layer.self_attn(ops, h, positions, self.cos_sin_cache, kv_cache, meta)
            norm = layer.post_attention_layernorm
            h, residual = ops.rms_norm(h, norm.weight, norm.eps, residual)
            x = layer.mlp(ops, h)
        out, _ = ops.rms_norm(x, self.norm.weight, self.norm.eps, residual)
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
