"""DeepSeek-V3.2's lightning indexer (DeepSeek Sparse Attention): which context tokens each query attends to.

Per token it writes one index key (``wk`` then LayerNorm, RoPE on its first ``qk_rope_head_dim`` dims, neox-style
unlike MLA's interleaved pairs in V3.2, interleaved in GLM-5) into its own block tensor beside the MLA latent, and scores every visible cached key
with ``sum_h w_h * relu(q_h . k / sqrt(D))``: ``index_n_heads`` queries from the q-LoRA latent (``wq_b``) and their
weights from the hidden state (``weights_proj``, in fp32 as DeepSeek keeps it). The ``index_topk`` best tokens are
returned as slots for `ops.sparse_mla`. DeepSeek's own code rotates q and k by a Hadamard matrix and scores in FP8;
a rotation leaves dot products unchanged, so the scores here are those of transformers' bf16/fp32 formulation.

The index keys are a per-token tensor of the same blocks as the latent: they share its block ids, its prefix-cache
entries, its tiers and its eviction, so a prefix hit carries its index keys with its latents.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import IndexerConfig
from engine.models.layers.mla import deinterleave
from kernels.ops import AttentionMetadata, Ops, query_rows

INDEX_KEY_NORM_EPS = 1e-6


class Indexer(nn.Module):
    """Replicated under tensor parallelism: every rank picks the same tokens for its heads."""

    def __init__(self, hidden_size: int, q_lora_rank: int, rope_dim: int, cfg: IndexerConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.topk, self.rope_dim = cfg.num_heads, cfg.head_dim, cfg.topk, rope_dim
        self.wq_b = nn.Linear(q_lora_rank, cfg.num_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(hidden_size, cfg.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(cfg.head_dim, eps=INDEX_KEY_NORM_EPS)
        self.weights_proj = nn.Linear(hidden_size, cfg.num_heads, bias=False)
        self.weights_proj.keep_fp32 = True
        self.scale = cfg.head_dim**-0.5
        self.interleaved = cfg.rope_interleaved

    def forward(self, ops: Ops, x: torch.Tensor, q_latent: torch.Tensor, positions: torch.Tensor,
                cos_sin: torch.Tensor, key_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Store the new tokens' index keys; returns each query row's chosen slots ``[T, topk]`` (-1: none)."""
        q = self.wq_b(q_latent).view(x.shape[0], self.num_heads, self.head_dim)
        k = F.layer_norm(self.wk(x), (self.head_dim,), self.k_norm.weight, self.k_norm.bias, self.k_norm.eps)
        q_rope, q_pass = q.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        k_rope, k_pass = k.unsqueeze(1).split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        if self.interleaved:  # q and k permuted alike: the scores are unchanged
            q_rope, k_rope = deinterleave(q_rope), deinterleave(k_rope)
        q_rope, k_rope = ops.rotary_embedding(positions, q_rope, k_rope, cos_sin)
        k = torch.cat([k_rope, k_pass], dim=-1)
        half = self.head_dim // 2  # store_kv writes a key and a value: the two halves of the one index key (the
        # rotary part alone may be all of it, when qk_rope_head_dim = index_head_dim)
        ops.store_kv(k[..., :half], k[..., half:], key_cache[..., :half], key_cache[..., half:], meta.slot_mapping)
        weights = self.weights_proj(x.float()) * self.num_heads**-0.5
        seq, pos = query_rows(meta.query_start_loc, meta.context_lens, x.shape[0])
        return ops.index_topk(torch.cat([q_rope, q_pass], dim=-1), weights, key_cache, meta.block_tables, seq, pos,
                              self.scale, self.topk, max_context_len=meta.max_context_len)
