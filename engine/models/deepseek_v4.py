"""DeepSeek-V4 (transformers' ``deepseek_v4``): hyper-connected layers of compressed attention and MoE.

Attention: one KV head whose keys are its values (``kv_proj``, RMS-normalized, the last ``rope_dim`` dims rotated in
interleaved pairs), queries from a q-LoRA latent (RMS-normalized per head), per-head sinks, and each query sees
- the last ``sliding_window`` tokens (every layer),
- plus, on compressed-sparse-attention layers, the ``index_topk`` entries its lightning indexer picks among those
  pooled from overlapping windows of ``2 x csa_rate`` tokens, or, on heavily-compressed layers, every entry pooled
  from ``hca_rate`` tokens that it has closed.
The output is rotated back at the query's position (values carry the keys' rotation) and projected per group of
heads (``o_a_proj``) then mixed (``o_b_proj``). MLPs are MoEs (`engine.models.layers.moe`: hash routing first, then
sqrt-softplus top-k; clamped SwiGLU), and the residual is ``hc_mult`` streams (`engine.models.layers.hyper_connections`).

Cache: a layer's keys (``[block, 1, head_dim]`` a token) are read only within the window, so they live in the window
group's pages (`engine.kv.window_pool`: a running sequence holds its last window, the prefix cache retains windows
where requests resume); its compressed entries and their pooling state (`engine.models.layers.compressor`) are read
over the whole context and stay in the full-attention blocks under the sequence's block ids
(``BlockTensor.whole_context``). The compressors pool the step's own hidden states and the state at the block before,
never older keys, so a hit at P needs blocks [0, P) and the window's keys (P - W, P). With
``--no-sliding-window-cache`` the keys share the blocks too. Tensor parallelism splits the experts and the vocabulary;
attention is replicated (one KV head), as transformers' plan has it.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig, V4Config
from engine.models.kv_cache_spec import BlockTensor, KVCacheSpec, KVCaches
from engine.models.layers.compressor import CompressedIndexer, Compressor, entry_rows, entry_view
from engine.models.layers.hyper_connections import HyperConnection, HyperHead, unweighted_rms_norm
from engine.models.llama import RMSNorm
from engine.models.layers.moe import make_mlp
from engine.models.layers.rope import build_cos_sin_cache, rotate_pairs
from engine.parallel.linear import VocabParallelEmbedding, lm_head_parallel
from engine.parallel.state import SINGLE, TensorParallel
from kernels.ops import AttentionMetadata, Ops, pooling_state_size, positions_to_slots, query_rows


class GroupedLinear(nn.Linear):
    """``o_a_proj``: the heads' outputs in ``groups`` groups, each projected by its own block of the weight
    (``[groups * out, in_per_group]``)."""

    fp8_gemm = False  # its FP8 checkpoint weights are dequantized on load: the block GEMM is not grouped

    def __init__(self, in_per_group: int, out_features: int, groups: int) -> None:
        super().__init__(in_per_group, out_features, bias=False)
        self.groups = groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, groups, in_per_group]`` -> ``[T, out_features]``."""
        w = self.weight.view(self.groups, -1, x.shape[-1])
        return torch.einsum("tgi,goi->tgo", x, w).flatten(1)


class V4Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, v4: V4Config, layer_idx: int) -> None:
        super().__init__()
        eps, hidden = cfg.rms_norm_eps, cfg.hidden_size
        self.num_heads, self.head_dim, self.window = cfg.num_heads, v4.head_dim, v4.sliding_window
        self.rate = v4.compress_rates[layer_idx]
        self.q_a_proj = nn.Linear(hidden, v4.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(v4.q_lora_rank, eps)
        self.q_b_proj = nn.Linear(v4.q_lora_rank, cfg.num_heads * v4.head_dim, bias=False)
        self.kv_proj = nn.Linear(hidden, v4.head_dim, bias=False)
        self.kv_norm = RMSNorm(v4.head_dim, eps)
        self.o_a_proj = GroupedLinear(cfg.num_heads * v4.head_dim // v4.o_groups, v4.o_groups * v4.o_lora_rank,
                                      v4.o_groups)
        self.o_b_proj = nn.Linear(v4.o_groups * v4.o_lora_rank, hidden, bias=False)
        self.sinks = nn.Parameter(torch.empty(cfg.num_heads))
        self.eps, self.scale = eps, v4.head_dim**-0.5
        self.compressor: Compressor | None = None
        if self.rate == v4.csa_rate:
            self.compressor = Compressor(hidden, v4.head_dim, self.rate, overlap=True, eps=eps)
            self.compressor.indexer = CompressedIndexer(hidden, v4, eps)
        elif self.rate:
            self.compressor = Compressor(hidden, v4.head_dim, self.rate, overlap=False, eps=eps)

    def block_tensors(self) -> tuple[BlockTensor, ...]:
        """Keys per token (the window group's, where there is one); compressed entries (a ``head_dim`` row per
        ``rate`` tokens: ``block / rate`` a block) and their pooling state per block, for the compressor and, on CSA
        layers, the indexer's: read over the whole context."""
        tensors = [BlockTensor((1, self.head_dim))]
        compressors = [] if self.compressor is None else [self.compressor, *self._indexer()]
        for c in compressors:
            tensors.append(BlockTensor((c.head_dim,), tokens_per_row=c.rate, whole_context=True))
        for c in compressors:
            tensors.append(BlockTensor((pooling_state_size(c.head_dim, c.overlap),), per_block=True, fp32=True,
                                       whole_context=True))
        return tuple(tensors)

    def _indexer(self) -> list[CompressedIndexer]:
        indexer = getattr(self.compressor, "indexer", None)
        return [] if indexer is None else [indexer]

    def forward(self, ops: Ops, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, ...], meta: AttentionMetadata) -> torch.Tensor:
        num_rows = x.shape[0]
        q_latent = ops.rms_norm(self.q_a_proj(x), self.q_a_norm.weight, self.q_a_norm.eps)
        q = unweighted_rms_norm(self.q_b_proj(q_latent).view(num_rows, self.num_heads, self.head_dim), self.eps)
        q = rotate_pairs(q, positions, cos_sin)
        kv = ops.rms_norm(self.kv_proj(x), self.kv_norm.weight, self.kv_norm.eps)
        kv = rotate_pairs(kv, positions, cos_sin).unsqueeze(1)
        keys = kv_cache[0]
        # the keys' pages: the window group's slots and tables, where there is one
        key_meta = meta if meta.window is None else meta.window
        half = self.head_dim // 2  # store_kv writes a key and a value: the two halves of the one K = V row
        ops.store_kv(kv[..., :half], kv[..., half:], keys[..., :half], keys[..., half:], key_meta.slot_mapping)
        seq, pos = query_rows(meta.query_start_loc, meta.context_lens, num_rows)
        window = pos[:, None] - torch.arange(self.window - 1, -1, -1, device=pos.device)
        sources = [(keys.view(-1, self.head_dim), positions_to_slots(torch.where(window >= 0, window, -1), seq,
                                                                     key_meta.block_tables, keys.shape[1]))]
        if self.compressor is not None:
            sources.append(self._compressed(ops, x, q_latent, seq, pos, kv_cache, meta, cos_sin))
        out = ops.sink_attention(q, sources, self.sinks, self.scale)
        out = rotate_pairs(out, positions, cos_sin, inverse=True)
        return self.o_b_proj(self.o_a_proj(out.reshape(num_rows, self.o_a_proj.groups, -1)))

    def _compressed(self, ops: Ops, x: torch.Tensor, q_latent: torch.Tensor, seq: torch.Tensor, pos: torch.Tensor,
                    kv_cache: tuple[torch.Tensor, ...], meta: AttentionMetadata, cos_sin: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pool this step's tokens; returns the compressed entries' rows and each query row's picks of them."""
        if self._indexer():  # block tensors in `block_tensors` order
            _, entries, index_entries, state, index_state = kv_cache
        else:
            _, entries, state = kv_cache
        self.compressor(ops, x, entries, state, meta, cos_sin)
        if self._indexer():
            indexer = self._indexer()[0]
            indexer(ops, x, index_entries, index_state, meta, cos_sin)
            picks = indexer.choose(ops, x, q_latent, seq, pos, index_entries, meta, cos_sin)
        else:  # every entry the token has closed
            closed = (pos + 1) // self.rate
            windows = torch.arange(max(1, meta.max_context_len // self.rate), device=pos.device)[None, :]
            windows = torch.where(windows < closed[:, None], windows, -1)
            picks = entry_rows(windows, seq, meta.block_tables, entries.shape[1])
        return entry_view(entries, self.head_dim), picks


class V4DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, v4: V4Config, layer_idx: int, tp: TensorParallel) -> None:
        super().__init__()
        self.self_attn = V4Attention(cfg, v4, layer_idx)
        self.mlp = make_mlp(cfg, layer_idx, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn_hc = HyperConnection(cfg.hidden_size, v4, cfg.rms_norm_eps)
        self.ffn_hc = HyperConnection(cfg.hidden_size, v4, cfg.rms_norm_eps)
        self.rope_kind = "compress" if self.self_attn.rate else "main"


class DeepseekV4ForCausalLM(nn.Module):
    """Parameter names follow transformers' checkpoints (``save_pretrained`` of ``DeepseekV4ForCausalLM``)."""

    cuda_graphs = False  # the compressors plan on the host (torch reference ops)

    def __init__(self, cfg: ModelConfig, ops: Ops, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        assert cfg.v4 is not None
        self.cfg, self.v4, self.ops, self.tp = cfg, cfg.v4, ops, tp
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(V4DecoderLayer(cfg, cfg.v4, i, tp) for i in range(cfg.num_layers))
        self.hc_head = HyperHead(cfg.hidden_size, cfg.v4, cfg.rms_norm_eps)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = lm_head_parallel(cfg.hidden_size, cfg.vocab_size, tp)
        self.cos_sin: dict[str, torch.Tensor] = {}  # "main" (sliding-only layers) and "compress", by init_rope

    def tie_weights(self) -> None:
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def kv_cache_spec(self) -> KVCacheSpec:
        layers = [layer.self_attn.block_tensors() for layer in self.layers]
        return KVCacheSpec.per_layer("compressed", layers, self.v4.block_multiple,
                                     (self.v4.sliding_window,) * len(layers))

    def init_rope(self, max_positions: int, device: torch.device) -> None:
        v4 = self.v4
        self.cos_sin = {
            "main": build_cos_sin_cache(v4.rope_dim, max_positions, self.cfg.rope_theta, {}).to(device),
            "compress": build_cos_sin_cache(v4.rope_dim, max_positions, v4.compress_rope_theta,
                                            v4.compress_rope_scaling).to(device),
        }

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: KVCaches,
                meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` after the final norm, for every input token."""
        ops, tp = self.ops, self.tp
        x = tp.all_reduce(self.embed_tokens(input_ids))
        streams = x.unsqueeze(1).expand(-1, self.v4.hc_mult, -1).contiguous()
        for layer, kv_cache in zip(self.layers, kv_caches):
            post, comb, h = layer.attn_hc(streams)
            norm = layer.input_layernorm
            h = layer.self_attn(ops, ops.rms_norm(h, norm.weight, norm.eps), positions, self.cos_sin[layer.rope_kind],
                                kv_cache, meta)
            streams = HyperConnection.combine(streams, h, post, comb)
            post, comb, h = layer.ffn_hc(streams)
            norm = layer.post_attention_layernorm
            h = tp.all_reduce(layer.mlp(ops, ops.rms_norm(h, norm.weight, norm.eps), input_ids))
            streams = HyperConnection.combine(streams, h, post, comb)
        return ops.rms_norm(self.hc_head(streams), self.norm.weight, self.norm.eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.tp.gather_to_first(self.lm_head(hidden))
        return None if logits is None else logits[:, : self.cfg.vocab_size].float()
