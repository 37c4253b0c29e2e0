"""Pure-torch reference ops of DeepSeek Sparse Attention (DeepSeek-V3.2): the lightning indexer's top-k and the
absorbed MLA over the chosen tokens. `kernels.triton.sparse` has the same signatures.

Shapes as in `kernels.reference` (T query rows of the flattened batch, pages ``[num_blocks, block_size, 1, D]``).
The indexer names the tokens a query attends to by their **slots** (``page * block_size + offset``), so attention
reads them straight from the pages without the block tables; ``-1`` pads a row whose context is shorter than k.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.reference import gather_context

_ROWS_PER_CHUNK = 256  # sparse_mla gathers [rows, k, width] at a time


def query_rows(query_start_loc: torch.Tensor, context_lens: torch.Tensor, num_rows: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query row's sequence and position ``(seq [T], pos [T])``, int64, computed on the device (no host sync):
    the new tokens of sequence b are the last ``q_len`` positions of its context."""
    rows = torch.arange(num_rows, device=query_start_loc.device)
    seq = torch.searchsorted(query_start_loc[1:].long(), rows, right=True)
    pos = context_lens.long()[seq] - (query_start_loc.long()[seq + 1] - rows)
    return seq, pos


def positions_to_slots(positions: torch.Tensor, seq: torch.Tensor, block_tables: torch.Tensor,
                       block_size: int) -> torch.Tensor:
    """Context positions ``[T, k]`` of each row's sequence -> slots, int32; a negative position stays ``-1``."""
    valid = positions >= 0
    pos = positions.clamp(min=0).long()
    pages = block_tables.long()[seq[:, None], pos // block_size]
    return torch.where(valid, pages * block_size + pos % block_size, -1).to(torch.int32)


def index_scores(query: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """The lightning indexer's score of each key for each query, in fp32:
    ``sum_h weights[t, h] * relu(scale * query[t, h] . keys[s])``; ``query`` ``[n, H, D]``, ``weights`` ``[n, H]``,
    ``keys`` ``[S, D]`` -> ``[n, S]``."""
    per_head = torch.relu(torch.einsum("nhd,sd->nhs", query.float(), keys.float()) * scale)
    return torch.einsum("nh,nhs->ns", weights.float(), per_head)


def top_positions(scores: torch.Tensor, pos: torch.Tensor, topk: int) -> torch.Tensor:
    """The ``topk`` best-scored context positions of each row (``scores`` ``[n, S]`` over positions ``0..S-1``; row
    i sees positions ``<= pos[i]``), best first, ``-1`` where a row sees fewer."""
    causal = torch.arange(scores.shape[1], device=scores.device)[None, :] <= pos[:, None]
    scores = scores.masked_fill(~causal, float("-inf"))
    k = min(topk, scores.shape[1])
    best = scores.topk(k, dim=-1).indices
    best = torch.where(best <= pos[:, None], best, -1)
    return F.pad(best, (0, topk - k), value=-1)


def index_topk(
    query: torch.Tensor,
    weights: torch.Tensor,
    key_cache: torch.Tensor,
    block_tables: torch.Tensor,
    row_seq: torch.Tensor,
    row_last: torch.Tensor,
    scale: float,
    topk: int,
    *,
    max_context_len: int | None = None,
) -> torch.Tensor:
    """The slots ``[T, topk]`` int32 of the ``topk`` cached keys each query row scores highest (`index_scores`
    against ``key_cache`` ``[num_blocks, block_size, 1, D]``) among those it may see: positions ``0..row_last`` of
    its sequence ``row_seq`` (`query_rows`: a token sees itself and what precedes it; DeepSeek-V4's indexer sees
    the compressed entries its token has closed). Rows of one sequence are contiguous. ``query`` ``[T, H, D]``,
    ``weights`` ``[T, H]``; ``max_context_len`` (a bound on ``row_last + 1``) is the Triton kernel's launch hint."""
    num_rows = query.shape[0]
    out = torch.full((num_rows, topk), -1, dtype=torch.int32, device=query.device)
    seqs, lasts = row_seq.tolist(), row_last.tolist()
    block_size = key_cache.shape[1]
    start = 0
    while start < num_rows:
        end = start + 1
        while end < num_rows and seqs[end] == seqs[start]:
            end += 1
        visible = max(lasts[start:end]) + 1
        if visible > 0:
            keys = gather_context(key_cache, block_tables[seqs[start]], visible)[:, 0]
            best = top_positions(index_scores(query[start:end], weights[start:end], keys, scale), row_last[start:end],
                                 topk)
            out[start:end] = positions_to_slots(best, row_seq[start:end], block_tables, block_size)
        start = end
    return out


def sparse_mla(
    query: torch.Tensor,
    latent_cache: torch.Tensor,
    slots: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:
    """Absorbed multi-head latent attention of each query row over the cached rows at its ``slots`` ``[T, k]``
    (``-1``: none; every row has at least one). ``query`` ``[T, H, L + R]`` and ``latent_cache`` as in
    `kernels.reference.mla_decode`; returns ``[T, H, L]``, in the latent space."""
    num_rows, num_heads, width = query.shape
    out = query.new_empty(num_rows, num_heads, kv_lora_rank)
    flat = latent_cache.view(-1, width)
    for start in range(0, num_rows, _ROWS_PER_CHUNK):
        rows = slice(start, start + _ROWS_PER_CHUNK)
        chosen = slots[rows]
        keys = flat.index_select(0, chosen.clamp(min=0).flatten().long()).view(*chosen.shape, width)
        keys = keys.to(query.dtype)[:, None]  # [n, 1, k, W]: the heads fold into the query length
        mask = torch.zeros(chosen.shape, dtype=query.dtype, device=query.device)
        mask = mask.masked_fill(chosen < 0, float("-inf"))[:, None, None, :]
        o = F.scaled_dot_product_attention(query[rows][:, None], keys, keys[..., :kv_lora_rank], attn_mask=mask,
                                           scale=scale)
        out[rows] = o[:, 0]
    return out
