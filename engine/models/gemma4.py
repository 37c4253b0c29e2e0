"""Gemma 4 (``gemma4``: the language model of the released Gemma4ForConditionalGeneration checkpoints, its vision
tower skipped; ``gemma4_text``: Gemma4ForCausalLM), as laid out by Gemma-4-31B: Gemma 3's decoder
(`engine.models.gemma3`: five window layers to one global layer, sandwich norms, scaled embeddings, a GELU MLP,
the logit softcap) with

- global layers of another shape: heads of ``global_head_dim``, their own KV head count, and with
  ``attention_k_eq_v`` no ``v_proj``: the values are ``k_proj``'s output, normalized apart from the keys. Each layer
  keeps K and V of its own shape (`KVCacheSpec.gqa_per_layer`); the keys are normed and rotated, the values not, so
  both are kept;
- "proportional" RoPE on the global layers (the first quarter of a 512-wide head's frequencies turn,
  `engine.models.layers.rope`), plain RoPE with base 10k on the window layers;
- q and k RMS-normalized with plain ``w`` gains, v without a gain, softmax scale 1, and every layer's output scaled
  by its learned ``layer_scalar``.

What the config says kvserve does not run (per-layer embeddings, shared KV layers, the MoE block) is refused in
`engine.family_config`.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from engine.config import ModelConfig
from engine.models.gemma3 import Gemma3DecoderLayer, Gemma3ForCausalLM
from engine.models.kv_cache_spec import KVCacheSpec
from engine.models.llama import Attention
from engine.parallel.linear import Part, column_parallel
from engine.parallel.state import SINGLE, TensorParallel
from kernels.ops import AttentionMetadata, Ops


def unit_rms_norm(ops: Ops, x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim without a gain (Gemma 4's values, Muse-Glimmer's q, k and embeddings)."""
    return ops.rms_norm(x, x.new_ones(x.shape[-1]), eps)


class Gemma4Attention(Attention):
    """One layer's attention: a window layer's, or a global layer's with its own head size and KV heads (and, with
    ``attention_k_eq_v``, q and k projections only)."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, layer_idx: int) -> None:
        window, shape = cfg.layer_window(layer_idx), cfg.gemma4
        cfg = dataclasses.replace(cfg, head_dim=shape.head_dims[layer_idx], num_kv_heads=shape.kv_heads[layer_idx])
        super().__init__(cfg, tp, window)
        self.k_eq_v = window is None and shape.k_eq_v
        if self.k_eq_v:
            self.qkv_proj = column_parallel(cfg.hidden_size, [Part(cfg.num_heads, cfg.head_dim),
                                                              Part(cfg.num_kv_heads, cfg.head_dim)], tp,
                                            cfg.attention_bias)
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
        qkv = self.qkv_proj(x)
        if self.k_eq_v:
            q, k = qkv.split([self.q_size, self.kv_size], dim=-1)
            v = k
        else:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(ops, q.view(-1, self.num_heads, self.head_dim))
        k = self.k_norm(ops, k.view(-1, self.num_kv_heads, self.head_dim))
        v = unit_rms_norm(ops, v.reshape(-1, self.num_kv_heads, self.head_dim), self.eps)
        q, k = self.rotate(ops, positions, q, k, cos_sin)
        return self.o_proj(self.attend(ops, q, k, v, kv_cache, meta))


class Gemma4DecoderLayer(Gemma3DecoderLayer):
    """Gemma 3's layer; its output (the residual stream after it) is scaled by ``layer_scalar``."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, mixer: nn.Module, tp: TensorParallel) -> None:
        super().__init__(cfg, layer_idx, mixer, tp)
        self.layer_scalar = nn.Parameter(torch.ones(1))


class Gemma4ForCausalLM(Gemma3ForCausalLM):
    layer_class = Gemma4DecoderLayer

    def __init__(self, cfg: ModelConfig, ops: Ops, tp: TensorParallel = SINGLE) -> None:
        assert cfg.gemma4 is not None, "a Gemma 4 config has its global layers' shape"
        super().__init__(cfg, ops, tp)

    def make_mixer(self, layer_idx: int) -> nn.Module:
        return Gemma4Attention(self.cfg, self.tp, layer_idx)

    @property
    def global_rope_dim(self) -> int:
        return self.cfg.gemma4.global_head_dim

    def kv_cache_spec(self) -> KVCacheSpec:
        """This rank's K and V heads of every layer, in the layer's shape."""
        return KVCacheSpec.gqa_per_layer([(layer.mixer.num_kv_heads, layer.mixer.head_dim) for layer in self.layers],
                                         tuple(self.cfg.layer_window(i) for i in range(self.cfg.num_layers)))

    def end_layer(self, layer: nn.Module, out: torch.Tensor,
                  residual: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        return None, (residual + out) * layer.layer_scalar
