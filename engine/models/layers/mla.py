"""Multi-head latent attention (DeepSeek-V2/V3) over the paged latent cache.

Per token and layer the cache holds one row: the normalized latent ``c`` (``kv_lora_rank`` values) and the rotary
key ``k_rope`` shared by every head (``qk_rope_head_dim``). Head h's key is ``[W_uk[h] c, k_rope]`` and its value
``W_uv[h] c``, both decompressed by ``kv_b_proj``. Two equivalent ways to attend:

- decompressed (prefill chunks): gather the context's rows, decompress K and V per head, causal SDPA. Cheapest when
  many queries share one context.
- absorbed (decode rows): fold ``W_uk`` into the query (``q_nope W_uk[h]`` lives in latent space), attend over the
  cached rows directly with `ops.mla_decode`, and apply ``W_uv`` to the latent result. Reads 576 values per token
  instead of decompressing the whole context for a single query.

A mixed step sends its decode rows through the absorbed path and its prefill chunks through the decompressed one.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.models.llama import RMSNorm
from engine.models.layers.rope import yarn_softmax_scale
from engine.parallel.linear import Part, column_parallel, row_parallel
from engine.parallel.state import TensorParallel
from kernels.ops import AttentionMetadata, Ops, gather_context

LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: DeepSeek's (and transformers') default, not rms_norm_eps


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """``(x0, x1), (x2, x3), ...`` rotary pairs -> ``x0, x2, ..., x1, x3, ...``: DeepSeek's interleaved RoPE is then
    the neox-style rotation the ops implement (q and k are permuted alike, so their dot products are unchanged)."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


class MLAAttention(nn.Module):
    """Parameter names follow DeepSeek's checkpoints. Under tensor parallelism each rank holds a slice of the heads
    (``q_proj`` / ``q_b_proj``, ``kv_b_proj``, ``o_proj``); the latent projections, and so the latent cache, are
    replicated. Returns this rank's partial sum of ``o_proj``."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        mla = cfg.mla
        assert mla is not None
        self.num_heads = tp.split(cfg.num_heads)
        self.nope_dim, self.rope_dim, self.v_dim = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
        self.latent_dim = mla.kv_lora_rank
        self.interleaved = mla.rope_interleave
        self.rope = mla.rope
        q_heads = [Part(cfg.num_heads, self.nope_dim + self.rope_dim)]
        if mla.q_lora_rank is None:
            self.q_proj = column_parallel(cfg.hidden_size, q_heads, tp)
        else:
            self.q_a_proj = nn.Linear(cfg.hidden_size, mla.q_lora_rank, bias=cfg.attention_bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = column_parallel(mla.q_lora_rank, q_heads, tp)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, self.latent_dim + self.rope_dim, bias=cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.latent_dim, LATENT_NORM_EPS)
        self.kv_b_proj = column_parallel(self.latent_dim, [Part(cfg.num_heads, self.nope_dim + self.v_dim)], tp)
        self.o_proj = row_parallel(cfg.num_heads * self.v_dim, cfg.hidden_size, tp, bias=cfg.attention_bias,
                                   unit_size=self.v_dim)
        self.scale = (self.nope_dim + self.rope_dim) ** -0.5 * yarn_softmax_scale(cfg.rope_scaling)

    def _queries(self, ops: Ops, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every head's query ``[T, H, nope + rope]`` and the normalized q-LoRA latent it came from (None without
        q-LoRA; DeepSeek-V3.2's indexer reads it)."""
        if hasattr(self, "q_proj"):
            q, q_latent = self.q_proj(x), None
        else:
            norm = self.q_a_layernorm
            q_latent = ops.rms_norm(self.q_a_proj(x), norm.weight, norm.eps)
            q = self.q_b_proj(q_latent)
        return q.view(x.shape[0], self.num_heads, self.nope_dim + self.rope_dim), q_latent

    def project_and_store(
        self, ops: Ops, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Write the new tokens' latent rows into ``cache``; returns the queries ``(q_nope, q_rope)`` (rotated) and
        the q-LoRA latent."""
        q, q_latent = self._queries(ops, x)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.latent_dim, self.rope_dim], dim=-1)
        latent = ops.rms_norm(latent, self.kv_a_layernorm.weight, self.kv_a_layernorm.eps)
        k_rope = k_rope.unsqueeze(1)  # one rotary key for every head
        if self.rope:  # Kimi Linear's MLA has none: its "rotary" part is one more key part shared by the heads
            if self.interleaved:
                q_rope, k_rope = deinterleave(q_rope), deinterleave(k_rope)
            q_rope, k_rope = ops.rotary_embedding(positions, q_rope, k_rope, cos_sin)
        ops.store_kv(latent.unsqueeze(1), k_rope, cache[..., : self.latent_dim], cache[..., self.latent_dim :],
                     meta.slot_mapping)
        return q_nope, q_rope, q_latent

    def forward(
        self,
        ops: Ops,
        x: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        (cache,) = kv_cache
        q_nope, q_rope, _ = self.project_and_store(ops, x, positions, cos_sin, cache, meta)
        if meta.max_query_len == 1:  # decode-only: no host sync, CUDA-graph safe
            out = self._absorbed(ops, q_nope, q_rope, cache, meta.block_tables, meta.context_lens, meta.max_context_len)
        else:
            out = self._mixed(ops, q_nope, q_rope, cache, meta)
        return self.o_proj(out.flatten(1))

    def _split_kv_b(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``W_uk`` ``[H, nope, latent]`` and ``W_uv`` ``[H, v, latent]``: views of ``kv_b_proj``'s weight."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.latent_dim)
        return w[:, : self.nope_dim], w[:, self.nope_dim :]

    def _absorbed(self, ops: Ops, q_nope: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor,
                  block_tables: torch.Tensor, context_lens: torch.Tensor, max_context_len: int) -> torch.Tensor:
        """One query row per sequence -> ``[rows, H, v]``."""
        out_latent = ops.mla_decode(self.absorb_query(q_nope, q_rope), cache, block_tables, context_lens,
                                    self.scale, self.latent_dim, max_context_len=max_context_len)
        return self.values_from_latent(out_latent)

    def absorb_query(self, q_nope: torch.Tensor, q_rope: torch.Tensor) -> torch.Tensor:
        """``[rows, H, latent + rope]``: each head's ``q_nope W_uk[h]`` (its query in the latent space), then its
        rotary query."""
        w_uk, _ = self._split_kv_b()
        return torch.cat([torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1), q_rope], dim=-1)

    def values_from_latent(self, out_latent: torch.Tensor) -> torch.Tensor:
        """Attention outputs in the latent space ``[rows, H, latent]`` -> each head's value ``W_uv[h] o``."""
        _, w_uv = self._split_kv_b()
        return torch.bmm(out_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    def _mixed(self, ops: Ops, q_nope: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor:
        out = q_nope.new_empty(q_nope.shape[0], self.num_heads, self.v_dim)
        starts, lens = meta.query_start_loc.tolist(), meta.context_lens.tolist()
        decodes = [b for b in range(len(lens)) if starts[b + 1] - starts[b] == 1]
        if decodes:
            seqs = torch.tensor(decodes, device=out.device)
            rows = meta.query_start_loc[seqs].long()
            out[rows] = self._absorbed(ops, q_nope[rows], q_rope[rows], cache, meta.block_tables[seqs],
                                       meta.context_lens[seqs], max(lens[b] for b in decodes))
        for b, ctx_len in enumerate(lens):
            start, end = starts[b], starts[b + 1]
            if end - start > 1:
                out[start:end] = self._decompressed(q_nope[start:end], q_rope[start:end],
                                                    gather_context(cache, meta.block_tables[b], ctx_len)[:, 0])
        return out

    def _decompressed(self, q_nope: torch.Tensor, q_rope: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """A chunk's queries ``[n, H, *]`` (the last n positions of the context) over its cached ``rows``."""
        ctx_len, n = rows.shape[0], q_nope.shape[0]
        rows = rows.to(q_nope.dtype)
        kv = self.kv_b_proj(rows[:, : self.latent_dim]).view(ctx_len, self.num_heads, -1)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k_rope = rows[:, None, self.latent_dim :].expand(-1, self.num_heads, -1)
        q = torch.cat([q_nope, q_rope], dim=-1).transpose(0, 1)  # [H, n, D]
        k = torch.cat([k_nope, k_rope], dim=-1).transpose(0, 1)
        mask = None
        if n < ctx_len:  # a chunk after a cached prefix: causal, offset by the prefix
            mask = torch.arange(ctx_len - n, ctx_len, device=q.device)[:, None] >= torch.arange(ctx_len,
                                                                                              device=q.device)
        o = F.scaled_dot_product_attention(q, k, v.transpose(0, 1), attn_mask=mask, is_causal=mask is None,
                                           scale=self.scale)
        return o.transpose(0, 1)
