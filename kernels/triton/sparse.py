"""DeepSeek Sparse Attention in Triton (``kernels.reference.sparse``): the lightning indexer's scores and the
absorbed MLA over each query's chosen slots.

- ``index_topk``: one program per (query row, tile of context positions) scores its tile against every index head
  at once (``[heads, D] x [D, tile]``, ReLU, weighted sum over the heads) into a ``[rows, context]`` fp32 matrix,
  ``-inf`` past each row's position; ``torch.topk`` then picks the best and the block tables turn positions into
  slots, all on the device (no host sync, CUDA-graph safe). Rows are scored in chunks that bound that matrix.
- ``sparse_mla``: one program per (query row, tile of heads) walks the row's slots with an online softmax, as
  ``kernels.triton.mla`` walks a context, reading each chosen latent row once for all heads of the tile.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.reference.sparse import positions_to_slots
from kernels.triton.mla import latent_tile
from kernels.triton.utils import upcast_bf16_dot

BLOCK_N = 32  # context positions (index_topk) or slots (sparse_mla) per tile
BLOCK_H = 16  # heads per sparse_mla program: the smallest tile tl.dot takes
MAX_SCORES = 1 << 26  # index_topk scores at most this many (row, position) pairs at a time: 256 MiB of fp32
_LOG2E = 1.0 / math.log(2.0)


@triton.jit
def _index_scores_kernel(
    q_ptr, w_ptr, cache_ptr, block_tables_ptr, seq_ptr, pos_ptr, out_ptr,
    scale, num_heads, width,
    stride_qt, stride_qh, stride_wt, stride_cb, stride_cs, stride_bt, stride_ot,
    DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HEADS: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr, DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    row = tl.program_id(0)
    positions = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    seq = tl.load(seq_ptr + row)
    last = tl.load(pos_ptr + row)  # the row's own position: it sees 0..last
    visible = positions <= last
    heads = tl.arange(0, BLOCK_HEADS)
    head_valid = heads < num_heads
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < DIM
    q = tl.load(q_ptr + row.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                mask=head_valid[:, None] & dim_valid[None, :], other=0.0)
    w = tl.load(w_ptr + row.to(tl.int64) * stride_wt + heads, mask=head_valid, other=0.0).to(tl.float32)
    page = tl.load(block_tables_ptr + seq * stride_bt + positions // PAGE_SIZE, mask=visible, other=0).to(tl.int64)
    keys = tl.load(cache_ptr + page[:, None] * stride_cb + (positions % PAGE_SIZE)[:, None] * stride_cs
                   + dims[None, :], mask=visible[:, None] & dim_valid[None, :], other=0.0)
    keys = keys.to(q.dtype)  # pages may hold another dtype than the query: compute in the query's
    if DOT_FP32:
        q = q.to(tl.float32)
        keys = keys.to(tl.float32)
    per_head = tl.maximum(tl.dot(q, tl.trans(keys), input_precision=DOT_PRECISION) * scale, 0.0)
    score = tl.sum(w[:, None] * per_head, axis=0)
    score = tl.where(visible, score, float("-inf"))
    tl.store(out_ptr + row.to(tl.int64) * stride_ot + positions, score, mask=positions < width)


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
    """Same contract as ``kernels.reference.sparse.index_topk``. ``max_context_len``: the host-side bound of
    ``row_last + 1`` (avoids a device sync; under CUDA-graph capture a fixed upper bound)."""
    num_rows, num_heads, dim = query.shape
    page_size = key_cache.shape[1]
    assert query.stride(-1) == 1 and key_cache.stride(-1) == 1 and block_tables.stride(-1) == 1
    out = torch.full((num_rows, topk), -1, dtype=torch.int32, device=query.device)
    if num_rows == 0:
        return out
    width = max(1, max_context_len if max_context_len is not None else int(row_last.max()) + 1)
    seq, pos = row_seq, row_last
    weights = weights.float().contiguous()
    dot_precision = "ieee" if query.dtype == torch.float32 else "tf32"
    rows_per_chunk = max(1, MAX_SCORES // width)
    k = min(topk, width)
    for first in range(0, num_rows, rows_per_chunk):
        rows = slice(first, min(num_rows, first + rows_per_chunk))
        q, n = query[rows], rows.stop - rows.start
        scores = torch.empty(n, width, dtype=torch.float32, device=query.device)
        _index_scores_kernel[(n, triton.cdiv(width, BLOCK_N))](
            q, weights[rows], key_cache, block_tables, seq[rows], pos[rows], scores,
            scale, num_heads, width,
            q.stride(0), q.stride(1), weights.stride(0), key_cache.stride(0), key_cache.stride(1),
            block_tables.stride(0), scores.stride(0),
            DIM=dim, BLOCK_D=max(16, triton.next_power_of_2(dim)),
            BLOCK_HEADS=max(16, triton.next_power_of_2(num_heads)), BLOCK_N=BLOCK_N, PAGE_SIZE=page_size,
            DOT_FP32=upcast_bf16_dot(query.dtype), DOT_PRECISION=dot_precision,
        )
        best = scores.topk(k, dim=-1).indices
        best = torch.where(best <= pos[rows, None], best, -1)
        out[rows, :k] = positions_to_slots(best, seq[rows], block_tables, page_size)
    return out


@triton.jit
def _sparse_mla_kernel(
    q_ptr, cache_ptr, slots_ptr, out_ptr,
    qk_scale, num_heads, num_slots,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_st,
    LATENT: tl.constexpr, ROPE: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    row = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_valid = heads < num_heads
    lat = tl.arange(0, BLOCK_L)
    lat_valid = lat < LATENT
    rope = tl.arange(0, BLOCK_R)
    rope_valid = rope < ROPE
    q_rows = q_ptr + row.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
    q_lat = tl.load(q_rows + lat[None, :], mask=head_valid[:, None] & lat_valid[None, :], other=0.0)
    q_rope = tl.load(q_rows + LATENT + rope[None, :], mask=head_valid[:, None] & rope_valid[None, :], other=0.0)
    if DOT_FP32:
        q_lat = q_lat.to(tl.float32)
        q_rope = q_rope.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], dtype=tl.float32)
    for start in range(0, num_slots, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        slot = tl.load(slots_ptr + row.to(tl.int64) * stride_st + j, mask=j < num_slots, other=-1).to(tl.int64)
        chosen = slot >= 0
        slot = tl.maximum(slot, 0)
        rows = cache_ptr + (slot // PAGE_SIZE) * stride_cb + (slot % PAGE_SIZE) * stride_cs
        m_i, l_i, acc = latent_tile(q_ptr, q_lat, q_rope, m_i, l_i, acc, rows, chosen, lat, lat_valid, rope,
                                    rope_valid, qk_scale, LATENT, DOT_PRECISION)
    out = acc / l_i[:, None]  # every row chose at least its own token
    tl.store(out_ptr + row.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + lat[None, :],
             out.to(out_ptr.dtype.element_ty), mask=head_valid[:, None] & lat_valid[None, :])


def sparse_mla(
    query: torch.Tensor,
    latent_cache: torch.Tensor,
    slots: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:
    """Same contract as ``kernels.reference.sparse.sparse_mla``."""
    num_rows, num_heads, width = query.shape
    rope_dim = width - kv_lora_rank
    assert latent_cache.shape[-1] == width and latent_cache.stride(-1) == 1 and query.stride(-1) == 1
    assert slots.stride(-1) == 1
    out = query.new_empty(num_rows, num_heads, kv_lora_rank)
    if num_rows == 0:
        return out
    block_l = triton.next_power_of_2(kv_lora_rank)
    _sparse_mla_kernel[(num_rows, triton.cdiv(num_heads, BLOCK_H))](
        query, latent_cache, slots, out,
        scale * _LOG2E, num_heads, slots.shape[1],
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        latent_cache.stride(0), latent_cache.stride(1), slots.stride(0),
        LATENT=kv_lora_rank, ROPE=rope_dim, BLOCK_L=block_l, BLOCK_R=max(16, triton.next_power_of_2(rope_dim)),
        BLOCK_H=BLOCK_H, BLOCK_N=16 if block_l >= 512 else BLOCK_N, PAGE_SIZE=latent_cache.shape[1],
        DOT_FP32=upcast_bf16_dot(query.dtype), DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
    )
    return out
