"""MiniMax-M2 / M2.5 (``minimax_m2``: MiniMaxM2ForCausalLM): the Llama decoder with

- GQA full attention whose queries and keys are each RMS-normalized over *all* their heads at once (one norm of
  ``num_heads * head_dim`` for q, ``num_kv_heads * head_dim`` for k, before RoPE), unlike Qwen3's per-head norms;
- partial RoPE: the first ``rotary_dim`` dims of each head turn (neox style), the rest pass;
- an MoE MLP in every layer (`engine.models.layers.moe`): sigmoid scores, a correction bias that steers the top-k,
  the chosen scores renormalized; no shared expert.

The released checkpoints name the MoE ``block_sparse_moe`` with experts ``w1`` / ``w2`` / ``w3`` and the router's
bias beside the gate (renamed on load, engine/weights.py).
"""
from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.models.llama import Attention, LlamaForCausalLM
from engine.parallel.linear import Part, Sharding
from engine.parallel.state import TensorParallel
from kernels.ops import AttentionMetadata, Ops


class AcrossHeadsRMSNorm(nn.Module):
    """RMSNorm over every head of a projection at once (``weight`` ``[heads * head_dim]``, in fp32 as transformers).
    Under tensor parallelism a rank holds its heads' slice of the weight, and the sum of squares is summed over ranks
    (the KV heads must split over the ranks, not repeat on them: engine/parallel/sizes.py)."""

    def __init__(self, heads: int, head_dim: int, eps: float, tp: TensorParallel) -> None:
        super().__init__()
        self.sharding = Sharding(tp, 0, (Part(heads, head_dim),))
        self.weight = nn.Parameter(torch.ones(sum(self.sharding.local_sizes)))
        self.full_dim = heads * head_dim
        self.eps = eps
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        squares = self.tp.all_reduce(xf.pow(2).sum(-1, keepdim=True))
        return self.weight * (xf * torch.rsqrt(squares / self.full_dim + self.eps)).to(x.dtype)


class MiniMaxM2Attention(Attention):
    """Attention with q / k norms across heads (RoPE on the first ``rope_dim`` dims of each head: `Attention`)."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__(cfg, tp)
        self.q_norm = AcrossHeadsRMSNorm(cfg.num_heads, cfg.head_dim, cfg.rms_norm_eps, tp)
        self.k_norm = AcrossHeadsRMSNorm(cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps, tp)

    def forward(self, ops: Ops, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        hd = self.head_dim
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q).view(-1, self.num_heads, hd)
        k = self.k_norm(k).view(-1, self.num_kv_heads, hd)
        q, k = self.rotate(ops, positions, q, k, cos_sin)
        return self.o_proj(self.attend(ops, q, k, v.view(-1, self.num_kv_heads, hd), kv_cache, meta))


class MiniMaxM2ForCausalLM(LlamaForCausalLM):
    attention_class = MiniMaxM2Attention
