"""Hybrid decoders: Qwen3-Next (``qwen3_next``) and Qwen3.5 / 3.6 (``qwen3_5``, ``qwen3_5_moe``, the language model
of the released VLM checkpoints).

Three of every four layers are Gated DeltaNet linear attention, whose memory of the context is a recurrent state per
sequence (a causal-conv window and an fp32 delta-rule state, `kernels.reference.recurrent`) instead of K/V blocks;
the fourth is full attention with an output gate, partial RoPE and zero-centred q/k norms. Layer norms are
zero-centred ((1 + w) gains). MLPs are dense (3.5) or MoE with a gated shared expert (Next, 3.5-MoE), from
`engine.models.layers.moe`. The decoder loop is the Llama one; only the token mixers differ.

A recurrent layer's ``kv_cache`` is its ``(conv_state, ssm_state)`` pair indexed by state row; the step's
`StateBatch` (``meta.states``) says which slot each sequence uses and whether it continues a state.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import LinearAttentionConfig, ModelConfig
from engine.models.kv_cache_spec import KVCacheSpec, RecurrentStateSpec
from engine.models.llama import Attention, LlamaForCausalLM, RMSNorm
from engine.models.mtp import QwenMTPHead
from engine.parallel.linear import Part, Sharding, column_parallel, qkv_parallel, row_parallel
from engine.parallel.state import SINGLE, TensorParallel
from kernels.ops import AttentionMetadata, Ops


class GatedAttention(Attention):
    """Full attention whose ``q_proj`` gives each head its query and an output gate (``[q_h, gate_h]`` per head):
    ``o_proj(attention * sigmoid(gate))``. RoPE turns only the first ``rope_dim`` dims of each head."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__(cfg, tp)
        hd = cfg.head_dim
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, zero_centered=True)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, zero_centered=True)
        # q and gate interleaved per head: a rank's heads keep both halves
        self.qkv_proj = qkv_parallel(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, hd, tp, bias=cfg.attention_bias,
                                     q_unit=2 * hd)

    def forward(self, ops: Ops, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        hd = self.head_dim
        qg, k, v = self.qkv_proj(x).split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        qg = qg.view(-1, self.num_heads, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:].reshape(-1, self.q_size)
        q = self.q_norm(ops, q)
        k = self.k_norm(ops, k.view(-1, self.num_kv_heads, hd))
        v = v.view(-1, self.num_kv_heads, hd)
        q, k = self.rotate(ops, positions, q, k, cos_sin)
        return self.o_proj(self.attend(ops, q, k, v, kv_cache, meta) * torch.sigmoid(gate))


class CausalConv(nn.Module):
    """The depthwise causal conv's ``weight`` ``[channels, 1, kernel]`` over q, k and v; a rank holds its heads'
    channels of each."""

    def __init__(self, parts: list[Part], kernel: int, tp: TensorParallel) -> None:
        super().__init__()
        self.sharding = Sharding(tp, 0, tuple(parts))
        self.weight = nn.Parameter(torch.empty(sum(self.sharding.local_sizes), 1, kernel))


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet linear attention: q/k/v through a causal conv + SiLU, L2-normalised q/k, ``beta =
    sigmoid(b)``, ``g = -exp(A_log) * softplus(a + dt_bias)``, the gated delta rule over the sequence's state, then
    ``RMSNorm(o) * silu(z)`` and ``out_proj``.

    Projections: Qwen3.5 / 3.6 store ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``; Qwen3-Next
    ``in_proj_qkvz`` and ``in_proj_ba``, interleaved per key head (each key head's q, k, then its value heads' v
    and z). Both load into one fused ``in_proj``. Under tensor parallelism a rank holds whole key heads and their
    value heads."""

    recurrent = True  # its cache is a state per sequence, not blocks

    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        lin = cfg.linear
        assert lin is not None
        self.grouped = lin.grouped_projections
        self.num_k_heads, self.num_v_heads = tp.split(lin.num_key_heads), tp.split(lin.num_value_heads)
        self.dk, self.dv = lin.key_head_dim, lin.value_head_dim
        self.per_group = lin.num_value_heads // lin.num_key_heads  # value heads per key head
        qk, v = Part(lin.num_key_heads, self.dk), Part(lin.num_value_heads, self.dv)
        if self.grouped:
            parts = [Part(lin.num_key_heads, 2 * self.dk + 2 * self.per_group * self.dv),
                     Part(lin.num_key_heads, 2 * self.per_group)]
        else:
            parts = [qk, qk, v, v, Part(lin.num_value_heads), Part(lin.num_value_heads)]
        self.in_proj = column_parallel(cfg.hidden_size, parts, tp)
        self.conv1d = CausalConv([qk, qk, v], lin.conv_kernel, tp)
        self.sharding = Sharding(tp, 0, (Part(lin.num_value_heads),))  # A_log and dt_bias: per value head
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads))
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads))
        self.norm = RMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = row_parallel(lin.value_dim, cfg.hidden_size, tp, unit_size=self.dv)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``(mixed_qkv [T, C], z [T, Hv, Dv], b [T, Hv], a [T, Hv])`` of this rank's heads."""
        proj = self.in_proj(x)
        t, hk, hv = x.shape[0], self.num_k_heads, self.num_v_heads
        if not self.grouped:
            qkv_width = 2 * hk * self.dk + hv * self.dv
            z, b, a = proj[:, qkv_width:].split([hv * self.dv, hv, hv], dim=-1)
            return proj[:, :qkv_width], z.reshape(t, hv, self.dv), b, a
        g, dk = self.per_group, self.dk
        qkvz, ba = proj.split([hk * (2 * dk + 2 * g * self.dv), hk * 2 * g], dim=-1)
        q, k, v, z = qkvz.view(t, hk, -1).split([dk, dk, g * self.dv, g * self.dv], dim=-1)
        b, a = ba.view(t, hk, 2 * g).split([g, g], dim=-1)
        mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        return mixed, z.reshape(t, hv, self.dv), b.reshape(t, hv), a.reshape(t, hv)

    def forward(self, ops: Ops, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        conv_state, ssm_state = kv_cache
        t = x.shape[0]
        mixed, z, b, a = self._project(x)
        mixed = ops.causal_conv1d(mixed, self.conv1d.weight[:, 0], conv_state, meta.states)
        key_width = self.num_k_heads * self.dk
        q, k, v = mixed.split([key_width, key_width, self.num_v_heads * self.dv], dim=-1)
        beta = torch.sigmoid(b)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        out = ops.gated_delta_rule(q.view(t, -1, self.dk), k.view(t, -1, self.dk), v.view(t, -1, self.dv), g, beta,
                                   ssm_state, meta.states)
        out = (self.norm(ops, out).float() * F.silu(z.float())).to(x.dtype)
        return self.out_proj(out.reshape(t, -1))


class HybridForCausalLM(LlamaForCausalLM):
    """The Llama decoder loop over Gated DeltaNet and gated-attention layers (``cfg.linear.layer_types``); with
    ``cfg.num_mtp_layers``, the checkpoint's MTP layer as ``mtp`` (a draft model, `engine.models.mtp`)."""

    attention_class = GatedAttention

    def __init__(self, cfg: ModelConfig, ops: Ops, tp: TensorParallel = SINGLE) -> None:
        super().__init__(cfg, ops, tp)
        self.mtp = QwenMTPHead(cfg, GatedAttention(cfg, tp), tp) if cfg.num_mtp_layers else None

    def make_mixer(self, layer_idx: int) -> nn.Module:
        assert self.cfg.linear is not None
        if self.cfg.linear.is_linear(layer_idx):
            return GatedDeltaNet(self.cfg, self.tp)
        return GatedAttention(self.cfg, self.tp)

    def kv_cache_spec(self) -> KVCacheSpec:
        """Blocks for the attention layers; per recurrent layer a delta-rule state per slot (`delta_rule_state`)."""
        cfg = self.cfg
        assert cfg.linear is not None
        recurrent = tuple(cfg.linear.is_linear(i) for i in range(cfg.num_layers))
        state = delta_rule_state(cfg.linear, sum(recurrent), self.tp)
        if self.mtp is not None:  # its attention layer's pages come last, under the same block ids
            recurrent += (False,)
        blocks = KVCacheSpec.gqa(len(recurrent) - sum(recurrent), self.tp.split(cfg.num_kv_heads), cfg.head_dim)
        return KVCacheSpec(blocks.kind, blocks.num_layers, blocks.token_shapes, recurrent=state,
                           layer_is_recurrent=recurrent)


def delta_rule_state(lin: LinearAttentionConfig, num_layers: int, tp: TensorParallel) -> RecurrentStateSpec:
    """One sequence's state in each of ``num_layers`` recurrent layers (Gated DeltaNet, KDA), for this rank's heads:
    a conv window ``[C, K - 1]`` over q, k and v (model dtype) and an fp32 delta-rule state ``[Hv, Dk, Dv]``."""
    conv_channels = (tp.split(lin.num_key_heads) * 2 * lin.key_head_dim
                     + tp.split(lin.num_value_heads) * lin.value_head_dim)
    return RecurrentStateSpec(
        num_layers=num_layers,
        shapes=((conv_channels, lin.conv_kernel - 1), (tp.split(lin.num_value_heads), lin.key_head_dim,
                                                        lin.value_head_dim)),
        fp32=(False, True),
    )
