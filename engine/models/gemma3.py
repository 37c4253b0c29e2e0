"""Gemma 3 (``gemma3_text``: Gemma3ForCausalLM, the 270M / 1B checkpoints; ``gemma3``: the language model of the
released Gemma3ForConditionalGeneration checkpoints, whose vision tower runs apart, engine/models/vision/).

The Llama decoder with Gemma's differences:
- local and global layers (``cfg.sliding``: five sliding-window layers to one full-attention layer in the released
  models), each with its own RoPE base (10k local, 1M global, the global one possibly scaled);
- sandwich norms: every sub-block's output is normed before it joins the residual stream (``post_attention_layernorm``,
  ``post_feedforward_layernorm``), beside the usual pre-norms (``input_layernorm``, ``pre_feedforward_layernorm``);
- (1 + w) RMSNorm everywhere, q/k norm included; embeddings scaled by sqrt(hidden_size) (rounded to the model's
  dtype, as transformers does); a GELU(tanh) gated MLP; the softmax scale ``query_pre_attn_scalar ** -0.5``;
  optional final logit softcapping.

The local layers read only their window; with the window group (--sliding-window-cache, the default) they keep their
K/V in pages of their own and a running sequence holds only its window's (engine/kv/window_pool.py,
docs/SLIDING_WINDOW.md).
"""
from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.models.kv_cache_spec import KVCaches
from engine.models.llama import Attention, DecoderLayer, LlamaForCausalLM, RMSNorm
from engine.models.layers.rope import build_cos_sin_cache
from engine.models.vision.mrope import MultimodalStep
from engine.parallel.state import SINGLE, TensorParallel
from kernels.ops import AttentionMetadata, Ops


class Gemma3DecoderLayer(DecoderLayer):
    """The Llama layer (pre-attention norm, attention, ``post_attention_layernorm``, MLP) plus Gemma's norms around
    the MLP; ``post_attention_layernorm`` norms the attention output itself here, before the residual add."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, mixer: nn.Module, tp: TensorParallel) -> None:
        super().__init__(cfg, layer_idx, mixer, tp)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.zero_centered_norms)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.zero_centered_norms)


class Gemma3ForCausalLM(LlamaForCausalLM):
    layer_class = Gemma3DecoderLayer
    logit_multiplier = 1.0  # the logits' scale before the softcap (Muse-Glimmer's output_multiplier)

    def __init__(self, cfg: ModelConfig, ops: Ops, tp: TensorParallel = SINGLE) -> None:
        assert cfg.sliding is not None, "a Gemma 3 config has its local layers' window"
        super().__init__(cfg, ops, tp)
        self.local_cos_sin_cache: torch.Tensor | None = None  # the sliding layers' RoPE (init_rope)

    def make_mixer(self, layer_idx: int) -> nn.Module:
        return Attention(self.cfg, self.tp, window=self.cfg.layer_window(layer_idx))

    @property
    def global_rope_dim(self) -> int:
        """The rotary dims of a global layer's head (Gemma 4's are wider than the local layers')."""
        return self.rope_dim

    def init_rope(self, max_positions: int, device: torch.device) -> None:
        cfg, local = self.cfg, self.cfg.sliding
        self.cos_sin_cache = build_cos_sin_cache(self.global_rope_dim, max_positions, cfg.rope_theta,
                                                 cfg.rope_scaling).to(device)  # fp32, as every model's
        self.local_cos_sin_cache = build_cos_sin_cache(self.rope_dim, max_positions, local.rope_theta,
                                                       local.rope_scaling).to(device)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: KVCaches,
        meta: AttentionMetadata,
        mm: MultimodalStep | None = None,
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` after the final norm. Each residual add is fused into the norm after it:
        ``post_attention_layernorm``'s output joins the stream in ``pre_feedforward_layernorm``, and
        ``post_feedforward_layernorm``'s in the next layer's ``input_layernorm`` (or the final norm). ``mm``: the
        step's image tokens (Gemma 3's soft tokens replace the scaled embeddings, and see their whole image)."""
        ops, tp = self.ops, self.tp
        residual, out = self.embed(input_ids), None
        if mm is not None:
            residual, ops = mm.embed(residual), mm.attention_ops(ops)
        layer_inputs = self.layer_inputs(input_ids, residual, None if mm is None else mm.rows)
        rows = None
        for i, (layer, kv_cache) in enumerate(zip(self.layers, self.layer_caches(kv_caches))):
            # only the read rows from here on (not in a step with images: their rows are the whole batch's)
            if i == self.stores_no_kv_from and meta.read_rows is not None and mm is None:
                if not len(meta.read_rows):  # none (a chunk mid-prompt): the layers left would store nothing either
                    return residual.new_zeros(residual.shape)
                rows, meta, positions = meta.read_rows, meta.read, positions[meta.read_rows]
                residual, out = residual[rows], None if out is None else out[rows]
                layer_inputs = None if layer_inputs is None else layer_inputs[rows]
            attention = layer.mixer
            if out is None:
                h = layer.input_layernorm(ops, residual)
            else:
                h, residual = layer.input_layernorm(ops, out, residual)
            cos_sin = self.cos_sin_cache if attention.window is None else self.local_cos_sin_cache
            h = tp.all_reduce(attention(ops, h, positions, cos_sin, kv_cache, meta))
            h, residual = layer.pre_feedforward_layernorm(ops, layer.post_attention_layernorm(ops, h), residual)
            out = self.feed_forward(layer, h, residual)
            out, residual = self.end_layer(layer, out, residual, None if layer_inputs is None else layer_inputs[:, i])
        hidden = self.norm(ops, residual) if out is None else self.norm(ops, out, residual)[0]
        if rows is None:
            return hidden
        return hidden.new_zeros(len(input_ids), hidden.shape[-1]).index_copy_(0, rows, hidden)  # (the rows read)

    @property
    def stores_no_kv_from(self) -> int | None:
        """The first of the last layers that store no K/V (so, run on the read rows alone, leave every page as it
        would be); None: every layer stores its own."""
        return None

    def layer_caches(self, kv_caches: KVCaches) -> KVCaches:
        """Each layer's pages (Gemma 4's shared KV layers read an earlier layer's)."""
        return kv_caches

    def layer_inputs(self, input_ids: torch.Tensor, embeds: torch.Tensor,
                     image_rows: torch.Tensor | None) -> torch.Tensor | None:
        """Each token's input to every layer, ``[T, layers, size]`` (Gemma 4 E2B / E4B's per-layer embeddings);
        ``image_rows``: the rows whose ``embeds`` are an image's."""
        return None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The residual stream's start: the embeddings scaled by sqrt(hidden_size)."""
        x = self.tp.all_reduce(self.embed_tokens(input_ids))
        return x * torch.tensor(self.cfg.hidden_size**0.5, dtype=x.dtype)  # transformers rounds the scale to the dtype

    def feed_forward(self, layer: nn.Module, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The layer's MLP output, normed, on the MLP's input ``h`` (``residual``: the stream it was normed from)."""
        return layer.post_feedforward_layernorm(self.ops, self.tp.all_reduce(layer.mlp(self.ops, h)))

    def end_layer(self, layer: nn.Module, out: torch.Tensor, residual: torch.Tensor,
                  layer_input: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor]:
        """``(out, residual)`` after a layer, ``out`` still to be added to the stream (None: added already);
        ``layer_input``: the layer's row of `layer_inputs`."""
        return out, residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = super().compute_logits(hidden)
        cap = self.cfg.final_logit_softcapping
        if logits is None or cap is None:
            return logits
        return torch.tanh(logits * self.logit_multiplier / cap) * cap
