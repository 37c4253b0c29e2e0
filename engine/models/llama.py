"""One decoder for the Llama family: Llama, Mistral-style, Qwen2 (QKV bias), Qwen3 (q/k RMSNorm) and Qwen3-MoE
(Qwen3 with mixture-of-experts MLPs, `engine.models.layers.moe`). DeepSeek-V2/V3 reuse its loop with MLA attention.

Inputs are the flattened batch (all sequences' new tokens in one row dimension); attention reads and writes the
paged KV cache through the ops chosen in `kernels.ops`.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.models.kv_cache_spec import KVCacheSpec, KVCaches
from engine.models.layers.moe import make_mlp
from engine.models.layers.rope import build_cos_sin_cache
from engine.models.vision.mrope import MultimodalStep
from engine.parallel.linear import Part, Sharding, VocabParallelEmbedding, lm_head_parallel, qkv_parallel, row_parallel
from engine.parallel.state import SINGLE, TensorParallel
from kernels.ops import AttentionMetadata, Ops


class RMSNorm(nn.Module):
    """``zero_centered``: the checkpoint's weight w applies as ``1 + w`` (Qwen3-Next / 3.5)."""

    def __init__(self, dim: int, eps: float, zero_centered: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.zero_centered = zero_centered

    def forward(self, ops: Ops, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.zero_centered:
            return ops.rms_norm(x, self.weight, self.eps, residual, zero_centered=True)
        return ops.rms_norm(x, self.weight, self.eps, residual)


class Attention(nn.Module):
    """This rank's query heads and the KV heads they read; returns this rank's partial sum of ``o_proj``.
    ``window``: a sliding-window layer's (queries see the last ``window`` positions, their own included); ``sinks``
    (gpt-oss): one learned logit per query head that takes part in every row's softmax (`kernels.ops`)."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, window: int | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = tp.split(cfg.num_heads), tp.split(cfg.num_kv_heads)
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.qkv_proj = qkv_parallel(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, tp,
                                     bias=cfg.attention_bias)
        self.o_proj = row_parallel(cfg.num_heads * cfg.head_dim, cfg.hidden_size, tp, bias=cfg.o_proj_bias,
                                   unit_size=cfg.head_dim)
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if cfg.attention_sinks else None
        if self.sinks is not None:  # the module's own parameter (the sinks) is split with the query heads
            self.sharding = Sharding(tp, 0, (Part(cfg.num_heads),))
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.zero_centered_norms) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.zero_centered_norms) if cfg.qk_norm else None
        self.scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        self.window = window
        self.rope_dim = int(cfg.head_dim * cfg.partial_rotary_factor)

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
            q = self.q_norm(ops, q)
            k = self.k_norm(ops, k)
        q, k = self.rotate(ops, positions, q, k, cos_sin)
        return self.o_proj(self.attend(ops, q, k, v, kv_cache, meta))

    def rotate(self, ops: Ops, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
               cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE on the first ``rope_dim`` dims of every head ``[T, H, D]`` (all of them but in partial-RoPE models)."""
        rot = self.rope_dim
        if rot == self.head_dim:
            return ops.rotary_embedding(positions, q, k, cos_sin)
        q_rot, k_rot = ops.rotary_embedding(positions, q[..., :rot].contiguous(), k[..., :rot].contiguous(), cos_sin)
        return torch.cat([q_rot, q[..., rot:]], dim=-1), torch.cat([k_rot, k[..., rot:]], dim=-1)

    def attend(self, ops: Ops, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """Store the new tokens' K / V in their pages and attend: ``[T, heads * head_dim]``, before ``o_proj``."""
        ops.store_kv(k, v, *kv_cache, self.pages(meta).slot_mapping)
        return self.attend_stored(ops, q, kv_cache, meta)

    def attend_stored(self, ops: Ops, q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                      meta: AttentionMetadata) -> torch.Tensor:
        """Attend over K / V already in the pages (Gemma 4's shared KV layers read an earlier layer's)."""
        meta = self.pages(meta)
        out = ops.paged_attention(
            q, *kv_cache, meta.block_tables, meta.context_lens, meta.query_start_loc, self.scale,
            window=self.window, sinks=self.sinks, max_query_len=meta.max_query_len,
            max_context_len=meta.max_context_len,
        )
        return out.reshape(-1, self.q_size)

    def pages(self, meta: AttentionMetadata) -> AttentionMetadata:
        """The metadata of this layer's pages: the window group's for a window layer, when there is one."""
        return meta.window if self.window is not None and meta.window is not None else meta


class DecoderLayer(nn.Module):
    """Pre-norm residual block: a token mixer (``self_attn``, or a hybrid model's ``linear_attn`` unless the mixer
    says its ``checkpoint_name``) then the MLP."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, mixer: nn.Module, tp: TensorParallel) -> None:
        super().__init__()
        default = "linear_attn" if getattr(mixer, "recurrent", False) else "self_attn"
        self.mixer_name = getattr(mixer, "checkpoint_name", default)  # the checkpoints' names
        self.add_module(self.mixer_name, mixer)
        self.mlp = make_mlp(cfg, layer_idx, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.zero_centered_norms)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.zero_centered_norms)

    @property
    def mixer(self) -> nn.Module:
        return self._modules[self.mixer_name]


class LlamaForCausalLM(nn.Module):
    """Parameter names follow HF checkpoints, except the fused ``qkv_proj`` and ``gate_up_proj`` (see weights.py).

    Under tensor parallelism (``tp``) this is one rank's shard: the embedding, attention, MLPs and LM head each
    compute this rank's share, and the decoder loop sums the shares over ranks (engine/parallel/linear.py)."""

    attention_class: type[nn.Module] = Attention
    layer_class: type[DecoderLayer] = DecoderLayer

    def __init__(self, cfg: ModelConfig, ops: Ops, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.cfg = cfg
        self.ops = ops
        self.tp = tp
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(self.layer_class(cfg, i, self.make_mixer(i), tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.zero_centered_norms)
        self.lm_head = lm_head_parallel(cfg.hidden_size, cfg.vocab_size, tp)
        self.tie_weights()
        self.cos_sin_cache: torch.Tensor | None = None  # set by init_rope, after the weights have a device

    def make_mixer(self, layer_idx: int) -> nn.Module:
        """Layer ``layer_idx``'s token mixer (every layer: ``attention_class``)."""
        return self.attention_class(self.cfg, self.tp)

    def tie_weights(self) -> None:
        """Share the embedding with the output head (tied checkpoints); redo after moving off the meta device."""
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @property
    def rope_dim(self) -> int:
        """The rotary dims of a head: its first ``head_dim * partial_rotary_factor`` (Qwen3-Next / 3.5, MiniMax-M2)."""
        return int(self.cfg.head_dim * self.cfg.partial_rotary_factor)

    def kv_cache_spec(self) -> KVCacheSpec:
        """This rank's blocks: its KV heads of every token."""
        return KVCacheSpec.gqa(self.cfg.num_layers, self.tp.split(self.cfg.num_kv_heads), self.cfg.head_dim,
                               tuple(self.cfg.layer_window(i) for i in range(self.cfg.num_layers)))

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
        mm: MultimodalStep | None = None,
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` after the final norm, for every input token. ``mm``: the step's image tokens
        (a vision-language model's: their embeddings and multimodal positions, engine/models/vision/mrope.py)."""
        ops, tp = self.ops, self.tp
        x = tp.all_reduce(self.embed_tokens(input_ids))
        cos_sin = self.cos_sin_cache
        if mm is not None:
            x = mm.embed(x)
            positions, cos_sin = mm.rope(positions, cos_sin)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            if residual is None:
                residual = x
                h = layer.input_layernorm(ops, x)
            else:
                h, residual = layer.input_layernorm(ops, x, residual)
            h = tp.all_reduce(layer.mixer(ops, h, positions, cos_sin, kv_cache, meta))
            h, residual = layer.post_attention_layernorm(ops, h, residual)
            x = tp.all_reduce(layer.mlp(ops, h))
        out, _ = self.norm(ops, x, residual)
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """fp32 logits ``[rows, vocab]``, on rank 0 only (None on the other ranks: their blocks went to rank 0)."""
        logits = self.tp.gather_to_first(self.lm_head(hidden))
        return None if logits is None else logits[:, : self.cfg.vocab_size].float()
