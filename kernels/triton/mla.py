"""Paged multi-head latent attention for decode in Triton (``kernels.reference.mla_decode``), absorbed form.

Every head attends to the same cached rows: per token one normalized latent (``L`` = ``kv_lora_rank`` values, the
keys' and values' shared part) and one rotary key (``R`` values). With the key projection absorbed into the query, a
head's score is ``q_latent . latent + q_rope . rope_key`` and its output is the softmax-weighted sum of latents, so a
program handles a tile of heads of one sequence and reads each cached row once for all of them.

As in ``kernels.triton.attention``, long contexts with few programs take a split-K path: each program covers one
partition of the context and writes unnormalized partials that ``reduce_partitions`` merges.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.triton.attention import choose_partition_size, reduce_partitions, use_split_k
from kernels.triton.utils import upcast_bf16_dot

BLOCK_H = 16  # heads per program: the smallest tile tl.dot takes
MAX_PARTITIONS = 32  # split-K partials are [B, H, partitions, 512] fp32: bounded even at 160K-token contexts
_LOG2E = 1.0 / math.log(2.0)


def mla_partition_size(num_seqs: int, head_tiles: int, max_context_len: int, device: torch.device) -> int:
    """``paged_attention``'s choice, made coarser where it would cut ``max_context_len`` into more than
    ``MAX_PARTITIONS`` partitions (a CUDA graph sizes them for the whole model length)."""
    size = choose_partition_size(num_seqs, head_tiles, max_context_len, device)
    return max(size, triton.next_power_of_2(triton.cdiv(max_context_len, MAX_PARTITIONS)))


@triton.jit
def latent_tile(q_ptr, q_lat, q_rope, m_i, l_i, acc, rows, valid, lat, lat_valid, rope, rope_valid, qk_scale,
                LATENT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One tile of cached latent rows (``rows``: their addresses, ``valid``: which count) folded into every head's
    online softmax ``(m_i, l_i, acc)``: scores ``q_latent . latent + q_rope . rope_key``, values the latents."""
    latent = tl.load(rows[:, None] + lat[None, :], mask=valid[:, None] & lat_valid[None, :], other=0.0)
    rope_key = tl.load(rows[:, None] + LATENT + rope[None, :], mask=valid[:, None] & rope_valid[None, :], other=0.0)
    latent = latent.to(q_lat.dtype)  # pages may hold another dtype than the query: compute in the query's
    s = tl.dot(q_lat, tl.trans(latent), input_precision=DOT_PRECISION)
    s += tl.dot(q_rope, tl.trans(rope_key.to(q_rope.dtype)), input_precision=DOT_PRECISION)
    s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a tile of padding before any row (sparse slots)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    p = p.to(q_ptr.dtype.element_ty).to(q_lat.dtype)  # rounded to the input dtype, as in flash attention
    acc = acc * alpha[:, None] + tl.dot(p, latent, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _mla_decode_kernel(
    q_ptr, cache_ptr, out_ptr, block_tables_ptr, context_lens_ptr,
    part_acc_ptr, part_max_ptr, part_sum_ptr,
    qk_scale, num_heads, num_partitions, partition_size,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_cb, stride_cs, stride_bt,
    LATENT: tl.constexpr, ROPE: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    SPLIT: tl.constexpr, DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_valid = heads < num_heads
    lat = tl.arange(0, BLOCK_L)
    lat_valid = lat < LATENT
    rope = tl.arange(0, BLOCK_R)
    rope_valid = rope < ROPE
    q_rows = q_ptr + seq.to(tl.int64) * stride_qb + heads[:, None] * stride_qh
    q_lat = tl.load(q_rows + lat[None, :], mask=head_valid[:, None] & lat_valid[None, :], other=0.0)
    q_rope = tl.load(q_rows + LATENT + rope[None, :], mask=head_valid[:, None] & rope_valid[None, :], other=0.0)
    if DOT_FP32:
        q_lat = q_lat.to(tl.float32)
        q_rope = q_rope.to(tl.float32)

    ctx_len = tl.load(context_lens_ptr + seq)
    if SPLIT:
        kv_start = tl.program_id(2) * partition_size
        kv_end = tl.minimum(ctx_len, kv_start + partition_size)
    else:
        kv_start = 0
        kv_end = ctx_len
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], dtype=tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start in range(kv_start, kv_end, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        pos_valid = pos < kv_end
        page = tl.load(table_row + pos // PAGE_SIZE, mask=pos_valid, other=0).to(tl.int64)
        rows = cache_ptr + page * stride_cb + (pos % PAGE_SIZE) * stride_cs
        m_i, l_i, acc = latent_tile(q_ptr, q_lat, q_rope, m_i, l_i, acc, rows, pos_valid, lat, lat_valid, rope,
                                    rope_valid, qk_scale, LATENT, DOT_PRECISION)

    if SPLIT:
        # Partials indexed [seq, head, partition], as reduce_partitions reads them; a partition past the context
        # saw no keys and stores max -inf, sum 0, which the reduce weighs as nothing.
        part_row = (seq * num_heads + heads).to(tl.int64) * num_partitions + tl.program_id(2)
        tl.store(part_max_ptr + part_row, m_i, mask=head_valid)
        tl.store(part_sum_ptr + part_row, l_i, mask=head_valid)
        tl.store(part_acc_ptr + part_row[:, None] * LATENT + lat[None, :], acc,
                 mask=head_valid[:, None] & lat_valid[None, :])
    else:
        out = acc / l_i[:, None]  # every decode context holds at least its own token
        tl.store(out_ptr + seq.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + lat[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=head_valid[:, None] & lat_valid[None, :])


def mla_decode(
    query: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    *,
    max_context_len: int | None = None,
    split_k: bool | None = None,
    partition_size: int | None = None,
) -> torch.Tensor:
    """Absorbed MLA decode; same contract as ``kernels.reference.mla_decode``.

    ``max_context_len`` sizes the split-K launch (pass the host-side bound to avoid a device sync; under CUDA-graph
    capture a fixed upper bound). ``split_k`` / ``partition_size``: None picks as ``paged_attention`` does, counting
    head tiles where it counts KV heads (both are the programs one sequence gets).
    """
    num_seqs, num_heads, width = query.shape
    page_size = latent_cache.shape[1]
    rope_dim = width - kv_lora_rank
    assert latent_cache.shape[-1] == width and latent_cache.stride(-1) == 1 and query.stride(-1) == 1
    assert block_tables.stride(-1) == 1 and page_size & (page_size - 1) == 0
    out = query.new_empty(num_seqs, num_heads, kv_lora_rank)
    if num_seqs == 0:
        return out
    if max_context_len is None:
        max_context_len = int(context_lens.max())
    head_tiles = triton.cdiv(num_heads, BLOCK_H)
    if split_k is None:
        split_k = use_split_k(num_seqs, head_tiles, 1, max_context_len, query.device)
    block_l = triton.next_power_of_2(kv_lora_rank)
    block_n = 16 if block_l >= 512 else 32  # a [BLOCK_N, 512] latent tile is the big shared-memory operand
    common = dict(
        LATENT=kv_lora_rank, ROPE=rope_dim, BLOCK_L=block_l, BLOCK_R=triton.next_power_of_2(rope_dim),
        BLOCK_H=BLOCK_H, BLOCK_N=block_n, PAGE_SIZE=page_size, DOT_FP32=upcast_bf16_dot(query.dtype),
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
    )
    strides = (query.stride(0), query.stride(1), out.stride(0), out.stride(1),
               latent_cache.stride(0), latent_cache.stride(1), block_tables.stride(0))
    qk_scale = scale * _LOG2E
    if not split_k:
        _mla_decode_kernel[(num_seqs, head_tiles, 1)](
            query, latent_cache, out, block_tables, context_lens, out, out, out,  # no partials on this path
            qk_scale, num_heads, 1, 0, *strides, SPLIT=False, **common,
        )
        return out
    if partition_size is None:
        partition_size = mla_partition_size(num_seqs, head_tiles, max_context_len, query.device)
    assert partition_size % block_n == 0, f"partition_size must be a multiple of {block_n}"
    num_partitions = max(1, triton.cdiv(max_context_len, partition_size))
    part_acc = torch.empty(num_seqs, num_heads, num_partitions, kv_lora_rank, dtype=torch.float32,
                           device=query.device)
    part_max = torch.empty(num_seqs, num_heads, num_partitions, dtype=torch.float32, device=query.device)
    part_sum = torch.empty_like(part_max)
    _mla_decode_kernel[(num_seqs, head_tiles, num_partitions)](
        query, latent_cache, out, block_tables, context_lens, part_acc, part_max, part_sum,
        qk_scale, num_heads, num_partitions, partition_size, *strides, SPLIT=True, **common,
    )
    one_row_each = torch.arange(num_seqs + 1, dtype=torch.int32, device=query.device)
    reduce_partitions(out.view(num_seqs, num_heads, kv_lora_rank), part_acc, part_max, part_sum, one_row_each)
    return out
