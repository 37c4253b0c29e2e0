"""DeepSeek-V4's compressors: windows of tokens pooled into compressed KV entries, and the lightning indexer that
picks which compressed entries a query of a compressed-sparse-attention layer attends to.

A layer's compressed entries live in the blocks whose tokens they pool: entry w (tokens ``w * rate``
onwards) in the block holding token ``w * rate``, at row ``w % (block_size / rate)`` of its ``[block_size / rate, D]``
block tensor. The pooling state of the windows still open lives in a row per
block (`kernels.reference.compressed`). So the prefix cache, the KV tiers and preemption treat them as they treat
the tokens' K: a hit on a block is a hit on its entries and on the state to resume after it.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.config import V4Config
from engine.models.llama import RMSNorm
from engine.models.layers.rope import rotate_pairs
from kernels.ops import AttentionMetadata, Ops, positions_to_slots


class Compressor(nn.Module):
    """Pools every ``rate`` tokens into one ``head_dim`` entry: per channel, the tokens' ``kv_proj`` weighted by
    the softmax of ``gate_proj`` + ``position_bias``; with ``overlap`` each token projects twice (``Ca``, ``Cb``) and
    an entry pools the previous window's ``Ca`` with its own ``Cb``. RMS-normalized, then rotated at its first
    token's position."""

    def __init__(self, hidden_size: int, head_dim: int, rate: int, overlap: bool, eps: float) -> None:
        super().__init__()
        width = 2 * head_dim if overlap else head_dim
        self.head_dim, self.rate, self.overlap = head_dim, rate, overlap
        self.kv_proj = nn.Linear(hidden_size, width, bias=False)
        self.gate_proj = nn.Linear(hidden_size, width, bias=False)
        self.position_bias = nn.Parameter(torch.empty(rate, width))
        self.kv_norm = RMSNorm(head_dim, eps)

    def forward(self, ops: Ops, x: torch.Tensor, entry_blocks: torch.Tensor, state: torch.Tensor,
                meta: AttentionMetadata, cos_sin: torch.Tensor) -> None:
        """Pool the step's tokens; write the entries they close into ``entry_blocks`` and the open windows into
        ``state``."""
        entries_per_block = entry_blocks.shape[1]
        pooled, seq, window = ops.pool_windows(
            self.kv_proj(x), self.gate_proj(x), self.position_bias, state, meta.block_tables, meta.context_lens,
            meta.query_start_loc, self.rate, self.overlap, entries_per_block * self.rate)
        if not len(pooled):
            return
        entries = ops.rms_norm(pooled, self.kv_norm.weight, self.kv_norm.eps)
        entries = rotate_pairs(entries, window * self.rate, cos_sin)
        rows = entry_rows(window[:, None], seq, meta.block_tables, entries_per_block)[:, 0]
        # stored as the keys are (FP8 blocks too): the entry rows as one-slot blocks, each half an entry
        blocks, half = entry_view(entry_blocks, self.head_dim)[:, None, None, :], self.head_dim // 2
        entries = entries.unsqueeze(1)
        ops.store_kv(entries[..., :half], entries[..., half:], blocks[..., :half], blocks[..., half:], rows.long())


def entry_view(entry_blocks: torch.Tensor, head_dim: int) -> torch.Tensor:
    """A layer's compressed entries ``[num_blocks, block_size / rate, head_dim]`` as rows."""
    return entry_blocks.view(-1, head_dim)


def entry_rows(windows: torch.Tensor, seq: torch.Tensor, block_tables: torch.Tensor,
               entries_per_block: int) -> torch.Tensor:
    """Rows of `entry_view` holding entries ``windows`` ``[T, n]`` of each row's sequence (``-1``: none)."""
    return positions_to_slots(windows, seq, block_tables, entries_per_block)


class IndexScorer(nn.Module):
    """``weights_proj``: each index head's weight per token (checkpoint name ``indexer.scorer.weights_proj``)."""

    def __init__(self, hidden_size: int, num_heads: int) -> None:
        super().__init__()
        self.weights_proj = nn.Linear(hidden_size, num_heads, bias=False)


class CompressedIndexer(Compressor):
    """The lightning indexer of compressed sparse attention: a compressor of its own at ``index_head_dim`` (with the
    layer's overlapping windows) for the index keys, then ``index_n_heads`` queries from the q-LoRA latent scored
    against the entries a token has closed, ``sum_h w_h relu(q_h . k)``; the ``index_topk`` best are attended."""

    def __init__(self, hidden_size: int, v4: V4Config, eps: float) -> None:
        super().__init__(hidden_size, v4.index_head_dim, v4.csa_rate, overlap=True, eps=eps)
        self.num_heads, self.topk = v4.index_num_heads, v4.index_topk
        self.q_b_proj = nn.Linear(v4.q_lora_rank, v4.index_num_heads * v4.index_head_dim, bias=False)
        self.scorer = IndexScorer(hidden_size, v4.index_num_heads)

    def choose(self, ops: Ops, x: torch.Tensor, q_latent: torch.Tensor, seq: torch.Tensor, pos: torch.Tensor,
               key_blocks: torch.Tensor, meta: AttentionMetadata, cos_sin: torch.Tensor) -> torch.Tensor:
        """Each query row's chosen compressed entries, as rows of `entry_view` ``[T, topk]`` (-1: none)."""
        q = self.q_b_proj(q_latent).view(x.shape[0], self.num_heads, self.head_dim)
        q = rotate_pairs(q, pos, cos_sin)
        weights = self.scorer.weights_proj(x).float() * self.num_heads**-0.5
        keys = key_blocks.view(key_blocks.shape[0], -1, 1, self.head_dim)  # entries as a paged cache of one head
        visible = (pos + 1) // self.rate - 1  # the last entry whose window this token has closed
        return ops.index_topk(q, weights, keys, meta.block_tables, seq, visible, self.head_dim**-0.5, self.topk,
                              max_context_len=max(1, meta.max_context_len // self.rate))
