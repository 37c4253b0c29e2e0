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
  by its learned ``layer_scalar``;
- in 26B-A4B, an MoE block beside every dense MLP: a router on the stream before the MLP's norm (normalized, scaled,
  softmax top-k renormalized, times a learned scale per expert) and GELU experts, each half normed apart and summed;
- in E2B / E4B, per-layer embeddings (`engine.models.layers.per_layer_embeddings`) and shared KV layers: the last
  ``num_kv_shared_layers`` layers project queries only and attend over the pages of the last unshared layer of their
  kind (window or global), keeping no pages of their own (the cache spec lists the unshared layers alone); E2B's
  shared layers have MLPs twice as wide.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

import torch.nn.functional as F

from engine.config import MoEConfig, ModelConfig
from engine.models.gemma3 import Gemma3DecoderLayer, Gemma3ForCausalLM
from engine.models.kv_cache_spec import KVCacheSpec, KVCaches
from engine.models.layers.moe import Experts
from engine.models.layers.per_layer_embeddings import PerLayerEmbeddings, PerLayerInput
from engine.models.llama import Attention, RMSNorm
from engine.parallel.linear import Part, column_parallel
from engine.parallel.state import SINGLE, TensorParallel
from kernels.ops import AttentionMetadata, Ops


def unit_rms_norm(ops: Ops, x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim without a gain (Gemma 4's values, Muse-Glimmer's q, k and embeddings)."""
    return ops.rms_norm(x, x.new_ones(x.shape[-1]), eps)


class Gemma4Attention(Attention):
    """One layer's attention: a window layer's, or a global layer's with its own head size and KV heads (and, with
    ``attention_k_eq_v``, q and k projections only); a shared KV layer's projects queries only."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, layer_idx: int) -> None:
        window, shape = cfg.layer_window(layer_idx), cfg.gemma4
        cfg = dataclasses.replace(cfg, head_dim=shape.head_dims[layer_idx], num_kv_heads=shape.kv_heads[layer_idx])
        super().__init__(cfg, tp, window)
        self.k_eq_v = window is None and shape.k_eq_v
        self.shares_kv = shape.kv_source(layer_idx) != layer_idx
        if self.shares_kv:  # (a released checkpoint's k_proj / v_proj / k_norm of these layers stay on disk)
            self.qkv_proj = self.k_norm = None
            self.q_proj = column_parallel(cfg.hidden_size, [Part(cfg.num_heads, cfg.head_dim)], tp, cfg.attention_bias)
        elif self.k_eq_v:
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
        if self.shares_kv:  # ``kv_cache``: the source layer's pages, this step's K / V already in them
            q = self.q_norm(ops, self.q_proj(x).view(-1, self.num_heads, self.head_dim))
            q = self.rotate(ops, positions, q, q[:, :1], cos_sin)[0]  # (rotate turns keys too: one head of q)
            return self.o_proj(self.attend_stored(ops, q, kv_cache, meta))
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


class Gemma4Router(nn.Module):
    """26B-A4B's router (transformers' Gemma4TextRouter): each token's top-k experts and their weights."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_experts, self.top_k = cfg.gemma4.experts.num_experts, cfg.gemma4.experts.top_k
        self.proj = nn.Linear(cfg.hidden_size, self.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(cfg.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(self.num_experts))
        self.eps = cfg.rms_norm_eps

    def forward(self, ops: Ops, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [T, K], expert ids [T, K])`` for the stream ``x`` ``[T, hidden]``."""
        h = unit_rms_norm(ops, x, self.eps) * self.scale * x.shape[-1] ** -0.5
        weights, ids = self.proj(h).float().softmax(-1).topk(self.top_k, dim=-1)
        return weights / weights.sum(-1, keepdim=True) * self.per_expert_scale[ids], ids


def run_experts(experts: Experts, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The weighted sum of each token's experts, ``down(gelu_tanh(gate) * up)``, expert by expert in transformers'
    order (`ops.fused_moe` runs SiLU experts only)."""
    out = torch.zeros_like(x)
    inter = experts.down_proj.shape[-1]
    for expert in ids.unique().tolist():
        token, slot = torch.where(ids == expert)
        gate, up = F.linear(x[token], experts.gate_up_proj[expert]).split(inter, dim=-1)
        y = F.linear(F.gelu(gate, approximate="tanh") * up, experts.down_proj[expert])
        out.index_add_(0, token, (y * weights[token, slot, None]).to(out.dtype))
    return out


class Gemma4DecoderLayer(Gemma3DecoderLayer):
    """Gemma 3's layer; its output (the residual stream after it) is scaled by ``layer_scalar``. With the MoE block,
    the router, the experts and the three norms around them; with per-layer embeddings, the layer's gate of them."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, mixer: nn.Module, tp: TensorParallel) -> None:
        shape = cfg.gemma4
        if shape.double_wide_mlp and shape.kv_source(layer_idx) != layer_idx:
            cfg = dataclasses.replace(cfg, intermediate_size=2 * cfg.intermediate_size)
        super().__init__(cfg, layer_idx, mixer, tp)
        self.layer_scalar = nn.Parameter(torch.ones(1))
        inputs = shape.per_layer_inputs
        self.per_layer_input = PerLayerInput(cfg.hidden_size, inputs.size, cfg.rms_norm_eps) if inputs else None
        block = shape.experts
        self.router = Gemma4Router(cfg) if block else None
        self.experts = Experts(cfg.hidden_size, MoEConfig(block.num_experts, block.top_k, block.intermediate_size,
                                                          (layer_idx,), True), tp) if block else None
        for name in ("post_feedforward_layernorm_1", "post_feedforward_layernorm_2", "pre_feedforward_layernorm_2"):
            setattr(self, name, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if block else None)


class Gemma4ForCausalLM(Gemma3ForCausalLM):
    layer_class = Gemma4DecoderLayer

    def __init__(self, cfg: ModelConfig, ops: Ops, tp: TensorParallel = SINGLE) -> None:
        assert cfg.gemma4 is not None, "a Gemma 4 config has its global layers' shape"
        if cfg.gemma4.experts is not None and tp.size > 1:
            raise ValueError("Gemma 4's MoE block does not run under tensor parallelism yet")
        super().__init__(cfg, ops, tp)
        inputs = cfg.gemma4.per_layer_inputs
        self.per_layer_embeddings = (PerLayerEmbeddings(inputs, cfg.hidden_size, cfg.num_layers, cfg.rms_norm_eps, tp)
                                     if inputs else None)

    def make_mixer(self, layer_idx: int) -> nn.Module:
        return Gemma4Attention(self.cfg, self.tp, layer_idx)

    @property
    def global_rope_dim(self) -> int:
        return self.cfg.gemma4.global_head_dim

    def kv_cache_spec(self) -> KVCacheSpec:
        """This rank's K and V heads of every layer that keeps them (all but the shared KV layers, which come last),
        in the layer's shape."""
        kept = self.layers[: self.cfg.gemma4.num_kv_layers]
        return KVCacheSpec.gqa_per_layer([(layer.mixer.num_kv_heads, layer.mixer.head_dim) for layer in kept],
                                         tuple(self.cfg.layer_window(i) for i in range(len(kept))))

    def layer_caches(self, kv_caches: KVCaches) -> KVCaches:
        return [kv_caches[self.cfg.gemma4.kv_source(i)] for i in range(self.cfg.num_layers)]

    @property
    def stores_no_kv_from(self) -> int | None:
        first = self.cfg.gemma4.num_kv_layers  # the shared KV layers (transformers skips them for rows it drops too)
        return first if first < self.cfg.num_layers else None

    def layer_inputs(self, input_ids: torch.Tensor, embeds: torch.Tensor,
                     image_rows: torch.Tensor | None) -> torch.Tensor | None:
        if self.per_layer_embeddings is None:
            return None
        if image_rows is not None:  # an image token's table row is the pad token's (as transformers' Gemma4Model)
            input_ids = input_ids.index_fill(0, image_rows, self.cfg.gemma4.per_layer_inputs.pad_token_id)
        return self.per_layer_embeddings(self.ops, input_ids, embeds)

    def feed_forward(self, layer: nn.Module, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        if layer.experts is None:
            return super().feed_forward(layer, h, residual)
        ops = self.ops
        dense = layer.post_feedforward_layernorm_1(ops, layer.mlp(ops, h))
        weights, ids = layer.router(ops, residual)  # the stream before the MLP's norm
        routed = run_experts(layer.experts, layer.pre_feedforward_layernorm_2(ops, residual), weights, ids)
        return layer.post_feedforward_layernorm(ops, dense + layer.post_feedforward_layernorm_2(ops, routed))

    def end_layer(self, layer: nn.Module, out: torch.Tensor, residual: torch.Tensor,
                  layer_input: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor]:
        stream = residual + out
        if layer.per_layer_input is not None:
            stream = layer.per_layer_input(self.ops, stream, layer_input)
        return None, stream * layer.layer_scalar
