"""Muse-Glimmer (``muse_glimmer``: the language model of the released MuseGlimmerForConditionalGeneration
checkpoints, its vision tower skipped): Gemma 3's decoder loop
(`engine.models.gemma3`: sliding-window and full layers, sandwich norms, the logit softcap) with

- three sliding-window layers (2,048 tokens) to one full-attention layer without RoPE (NoPE, every fourth counted
  back from the last; ``layer_rope_theta`` 0), the other layers sharing one RoPE;
- q and k RMS-normalized without a gain, q then times ``qk_scale_factor``, the softmax scale ``head_dim ** -0.5``;
- the attention output gated per element by ``sigmoid(gate_proj(x))`` before ``o_proj``;
- (1 + w) norms in the layers (the two after attention and the MLP with ``post_norm_eps``), a plain final norm,
  RMS-normalized embeddings (no gain, no scale), a SiLU MLP, untied embeddings, and logits times
  ``output_multiplier`` before the tanh softcap.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.models.gemma3 import Gemma3DecoderLayer, Gemma3ForCausalLM
from engine.models.gemma4 import unit_rms_norm
from engine.models.llama import Attention, RMSNorm
from engine.parallel.linear import Part, column_parallel
from engine.parallel.state import SINGLE, TensorParallel
from kernels.ops import AttentionMetadata, Ops


class MuseGlimmerAttention(Attention):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel, layer_idx: int) -> None:
        super().__init__(cfg, tp, window=cfg.layer_window(layer_idx))
        self.gate_proj = column_parallel(cfg.hidden_size, [Part(cfg.num_heads, cfg.head_dim)], tp)
        self.nope = layer_idx in cfg.muse_glimmer.nope_layers
        self.qk_scale_factor = cfg.muse_glimmer.qk_scale_factor
        self.eps = cfg.rms_norm_eps

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
        q = unit_rms_norm(ops, q.view(-1, self.num_heads, self.head_dim), self.eps) * self.qk_scale_factor
        k = unit_rms_norm(ops, k.view(-1, self.num_kv_heads, self.head_dim), self.eps)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if not self.nope:
            q, k = self.rotate(ops, positions, q, k, cos_sin)
        out = self.attend(ops, q, k, v, kv_cache, meta)
        return self.o_proj(out * torch.sigmoid(self.gate_proj(x)))


class MuseGlimmerDecoderLayer(Gemma3DecoderLayer):
    """Gemma 3's sandwich-normed layer; the norms after attention and after the MLP use ``post_norm_eps``."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, mixer: nn.Module, tp: TensorParallel) -> None:
        super().__init__(cfg, layer_idx, mixer, tp)
        eps = cfg.muse_glimmer.post_norm_eps
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, zero_centered=True)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, zero_centered=True)


class MuseGlimmerForCausalLM(Gemma3ForCausalLM):
    layer_class = MuseGlimmerDecoderLayer

    def __init__(self, cfg: ModelConfig, ops: Ops, tp: TensorParallel = SINGLE) -> None:
        assert cfg.muse_glimmer is not None, "a Muse-Glimmer config has its attention scalars"
        super().__init__(cfg, ops, tp)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # a plain gain, unlike the layers' norms
        self.logit_multiplier = cfg.muse_glimmer.output_multiplier

    def make_mixer(self, layer_idx: int) -> nn.Module:
        return MuseGlimmerAttention(self.cfg, self.tp, layer_idx)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return unit_rms_norm(self.ops, self.tp.all_reduce(self.embed_tokens(input_ids)), self.cfg.rms_norm_eps)
