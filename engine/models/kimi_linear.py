"""Kimi Linear (``kimi_linear``: KimiLinearForCausalLM, Kimi-Linear-48B-A3B): a hybrid of Kimi Delta Attention and
MLA, three KDA layers to one MLA layer, with DeepSeek-V3's MoE after a dense first layer.

- KDA (`KimiDeltaAttention`) is Gated DeltaNet's recurrence with a decay per key channel instead of one per head:
  q/k/v through a causal conv + SiLU, L2-normalised q/k, ``beta = sigmoid(b_proj x)``, the log decay
  ``g = -exp(A_log) * softplus(f_b_proj(f_a_proj x) + dt_bias)`` per head and channel, the gated delta rule over the
  sequence's state row (`kernels.reference.recurrent`, the op Qwen3.5 / 3.6 run, given a ``[T, H, Dk]`` decay),
  then a per-head RMSNorm gated by ``sigmoid(g_b_proj(g_a_proj x))`` and ``o_proj``.
- MLA (`engine.models.layers.mla`) without RoPE: the latent cache and absorbed decode as DeepSeek-V3's, the rotary
  key part shared by the heads unrotated.

Its cache is the hybrid's (docs/HYBRID_CACHE.md): latent pages for the MLA layers, a state per sequence (and
snapshots at block boundaries) for the KDA layers. Released names load as they are (engine/weights.py: q/k/v
convs into one, the forget gate's weights, block_sparse_moe and experts w1 / w2 / w3).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.models.kv_cache_spec import KVCacheSpec
from engine.models.layers.mla import MLAAttention
from engine.models.llama import LlamaForCausalLM, RMSNorm
from engine.models.qwen3_next import CausalConv, delta_rule_state
from engine.parallel.linear import Part, Sharding, column_parallel, row_parallel
from engine.parallel.state import TensorParallel
from kernels.ops import AttentionMetadata, Ops


class ForgetGate(nn.Module):
    """KDA's log decay per head and key channel: ``f_b_proj(f_a_proj x) + dt_bias`` through a softplus, times
    ``-exp(A_log)`` of the head (``A_log`` lives on the layer, shaped ``[1, 1, H, 1]`` as released)."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        lin = cfg.linear
        assert lin is not None
        heads = Part(lin.num_value_heads, lin.key_head_dim)
        self.f_a_proj = nn.Linear(cfg.hidden_size, lin.key_head_dim, bias=False)  # replicated: a low rank
        self.f_b_proj = column_parallel(lin.key_head_dim, [heads], tp)
        self.sharding = Sharding(tp, 0, (heads,))  # dt_bias: per head and channel
        self.dt_bias = nn.Parameter(torch.empty(sum(self.sharding.local_sizes)))

    def forward(self, x: torch.Tensor, a_log: torch.Tensor) -> torch.Tensor:
        g = (self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias.float()).view(x.shape[0], a_log.shape[0], -1)
        return -a_log.float().exp()[:, None] * F.softplus(g)


class KimiDeltaAttention(nn.Module):
    """Under tensor parallelism a rank holds whole heads: their q/k/v rows, conv channels, gates and state."""

    recurrent = True  # its cache is a state per sequence, not blocks
    checkpoint_name = "self_attn"  # the released checkpoints name both mixers self_attn

    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        lin = cfg.linear
        assert lin is not None and lin.channel_gate
        self.num_heads, self.head_dim = tp.split(lin.num_value_heads), lin.key_head_dim
        heads = Part(lin.num_value_heads, self.head_dim)
        self.qkv_proj = column_parallel(cfg.hidden_size, [heads, heads, heads], tp)  # q_proj, k_proj, v_proj
        self.conv1d = CausalConv([heads, heads, heads], lin.conv_kernel, tp)  # q_conv1d, k_conv1d, v_conv1d
        self.sharding = Sharding(tp, 2, (Part(lin.num_value_heads),))  # A_log [1, 1, H, 1]
        self.A_log = nn.Parameter(torch.empty(1, 1, self.num_heads, 1))
        self.forget_gate = ForgetGate(cfg, tp)
        self.b_proj = column_parallel(cfg.hidden_size, [Part(lin.num_value_heads)], tp)
        self.g_a_proj = nn.Linear(cfg.hidden_size, self.head_dim, bias=False)
        self.g_b_proj = column_parallel(self.head_dim, [heads], tp)
        self.o_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)  # per head, gated; applied in fp32 as transformers
        self.o_proj = row_parallel(lin.value_dim, cfg.hidden_size, tp, unit_size=self.head_dim)

    def forward(self, ops: Ops, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        conv_state, ssm_state = kv_cache
        t, shape = x.shape[0], (x.shape[0], self.num_heads, self.head_dim)
        mixed = ops.causal_conv1d(self.qkv_proj(x), self.conv1d.weight[:, 0], conv_state, meta.states)
        q, k, v = (part.reshape(shape) for part in mixed.chunk(3, dim=-1))
        g = self.forget_gate(x, self.A_log.view(-1))
        beta = torch.sigmoid(self.b_proj(x))
        out = ops.gated_delta_rule(q, k, v, g, beta, ssm_state, meta.states).float()
        gate = torch.sigmoid(self.g_b_proj(self.g_a_proj(x)).float().view(shape))
        out = ops.rms_norm(out, self.o_norm.weight.float(), self.o_norm.eps) * gate
        return self.o_proj(out.to(x.dtype).reshape(t, -1))


class KimiLinearForCausalLM(LlamaForCausalLM):
    """The Llama decoder loop over KDA and MLA layers (``cfg.linear.layer_types``)."""

    attention_class = MLAAttention

    def make_mixer(self, layer_idx: int) -> nn.Module:
        assert self.cfg.linear is not None
        if self.cfg.linear.is_linear(layer_idx):
            return KimiDeltaAttention(self.cfg, self.tp)
        return MLAAttention(self.cfg, self.tp)

    @property
    def rope_dim(self) -> int:
        assert self.cfg.mla is not None
        return self.cfg.mla.qk_rope_head_dim  # sizes the (unused) RoPE table: no layer rotates

    def kv_cache_spec(self) -> KVCacheSpec:
        """Latent pages for the MLA layers, a delta-rule state per slot for the KDA layers."""
        cfg, mla = self.cfg, self.cfg.mla
        assert cfg.linear is not None and mla is not None
        recurrent = tuple(cfg.linear.is_linear(i) for i in range(cfg.num_layers))
        blocks = KVCacheSpec.mla(len(recurrent) - sum(recurrent), mla.kv_lora_rank, mla.qk_rope_head_dim)
        return KVCacheSpec(blocks.kind, blocks.num_layers, blocks.token_shapes,
                           recurrent=delta_rule_state(cfg.linear, sum(recurrent), self.tp),
                           layer_is_recurrent=recurrent)
