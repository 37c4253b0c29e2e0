"""Paged attention over a flattened batch in Triton, with a split-K (flash-decoding) path for long decodes.

One kernel serves both paths. A program owns one sequence and one KV head; its rows are the (query row, query head
of the group) pairs of that sequence, so under GQA the K/V tiles it loads are shared by the whole head group. Keys
are walked in tiles of ``BLOCK_N`` positions whatever the page size: each position looks up its page in the block
table, so small pages (4 tokens in tests) still give ``tl.dot``-sized tiles.

- Direct path (grid axis 2 = query tile): online softmax over ``[0, causal end of the tile)``, normalized output.
  The key tiles before the tile's first row (a chunk's cached prefix: most of an agent turn's keys) are visible to
  every row: they run without the causal mask and bounds checks, only the tiles from there on are masked.
- Split path (grid axis 2 = context partition, decode-only batches): each program covers one partition of
  ``partition_size`` positions and writes its unnormalized accumulator with its running max and sum; a reduce
  kernel rescales and merges the partitions. This keeps the GPU busy when batch x KV heads is small and the
  context is long (batch-1 decode would otherwise run on a handful of SMs).

Sliding-window layers (``window``): a query at position p sees keys in ``(p - window, p]``. A tile's key walk starts
at its first row's window start instead of 0, so blocks wholly before the window are never read; the later rows of a
tile mask the keys before their own window. A decode reads at most ``window`` keys, so the split path's choice and its
partitions count the window, not the context (partition k covers the k-th ``partition_size`` keys of the window).

Attention sinks (``sinks``, gpt-oss): each query head's softmax starts from its sink, as if a key of score ``sink``
and value zero came first (running max = the sink, running sum = 1); on the split path only partition 0 carries it,
so the reduce counts it once.

Semantics and shapes are those of ``kernels.reference.paged_attention``.
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from kernels.triton.utils import num_compute_units, upcast_bf16_dot

MIN_PARTITION_SIZE, MAX_PARTITION_SIZE = 64, 512  # context positions per split-K partition
SPLIT_MIN_CONTEXT = 1024  # below this a decode's context is too short for splitting to beat one extra launch
SPLIT_K_ENV = "KVSERVE_SPLIT_K"  # "1" forces the split path for every decode-only batch, "0" disables it
_LOG2E = 1.0 / math.log(2.0)  # softmax runs in base 2: exp(x) == exp2(x * log2(e))


@triton.jit
def _attend_keys(
    acc, m_i, l_i, q_ptr, q, q_pos, k_cache_ptr, v_cache_ptr, table_row, kv_head, dims, dim_valid, kv_end, window,
    qk_scale, stride_ks, stride_kb, stride_kh, stride_vb, stride_vs, stride_vh, key_start, key_end,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, SLIDING: tl.constexpr,
    MASKED: tl.constexpr,
):
    """The online softmax over keys ``[key_start, key_end)`` in tiles of ``BLOCK_N``, each key looking up its page.
    ``MASKED`` False: every key of every tile is in the context and visible to every row (no checks)."""
    for start in range(key_start, key_end, BLOCK_N):
        k_pos = start + tl.arange(0, BLOCK_N)
        k_valid = k_pos < kv_end
        if MASKED:
            page = tl.load(table_row + k_pos // PAGE_SIZE, mask=k_valid, other=0).to(tl.int64)
        else:
            page = tl.load(table_row + k_pos // PAGE_SIZE).to(tl.int64)
        slot_in_page = k_pos % PAGE_SIZE
        kv_mask = k_valid[:, None] & dim_valid[None, :]
        k = tl.load(
            k_cache_ptr + page[:, None] * stride_kb + slot_in_page[:, None] * stride_ks
            + kv_head * stride_kh + dims[None, :],
            mask=kv_mask, other=0.0,
        )
        v = tl.load(
            v_cache_ptr + page[:, None] * stride_vb + slot_in_page[:, None] * stride_vs
            + kv_head * stride_vh + dims[None, :],
            mask=kv_mask, other=0.0,
        )
        # Pages may be stored in another dtype than the query; compute in the query's (like the reference).
        k = k.to(q.dtype)
        v = v.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if MASKED:
            visible = k_valid[None, :] & (k_pos[None, :] <= q_pos[:, None])
            if SLIDING:
                visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        if SLIDING:  # a row may see none of this tile's keys (its window starts later): no -inf - -inf
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        # Probabilities are rounded to the input dtype for the tensor-core dot, as in flash attention.
        p = p.to(q_ptr.dtype.element_ty).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, sinks_ptr,
    block_tables_ptr, context_lens_ptr, query_start_loc_ptr,
    part_acc_ptr, part_max_ptr, part_sum_ptr,
    qk_scale, window,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt, num_partitions, partition_size,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr, SLIDING: tl.constexpr,
    SINKS: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    chunk = tl.program_id(2)  # the query tile, or the context partition when SPLIT
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    ctx_len = tl.load(context_lens_ptr + seq)

    if SPLIT:
        tile = 0
    else:
        tile = chunk
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    q_row = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_valid = q_row < q_len
    # Padding rows borrow the last real row's position so that no row is masked everywhere (no NaN from -inf - -inf).
    q_pos = ctx_len - q_len + tl.minimum(q_row, q_len - 1)

    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < HEAD_DIM
    q_offs = (q_start + q_row).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_valid[:, None] & dim_valid[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)

    # Causal end of this tile: one past the position of its last real row (0 when the tile has no real row).
    last_row = tl.minimum((tile * BLOCK_M + BLOCK_M - 1) // GROUP, q_len - 1)
    kv_end = tl.where(tile * BLOCK_M < q_len * GROUP, ctx_len - q_len + last_row + 1, 0)
    kv_start = 0
    if SLIDING:  # nothing before the window of the tile's first row: those blocks are skipped, not masked
        first_row = tl.minimum((tile * BLOCK_M) // GROUP, q_len - 1)
        kv_start = tl.maximum(ctx_len - q_len + first_row - window + 1, 0)
    if SPLIT:  # partitions of the window (or of the whole context), from its start
        kv_start = kv_start + chunk * partition_size
        kv_end = tl.minimum(kv_end, kv_start + partition_size)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if SINKS:  # the sink as a first key of value zero (in base 2, unscaled: it is a logit already)
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        if SPLIT:  # partition 0 carries it
            m_i = tl.where(chunk == 0, sink, m_i)
            l_i = tl.where(chunk == 0, 1.0, l_i)
        else:
            m_i = sink
            l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    unmasked_end = kv_start
    if not SPLIT and not SLIDING:
        # Keys up to the tile's first row are visible to all its rows (the cached prefix of a chunk, most of a long
        # one): whole key tiles there skip the causal mask and the bounds checks; the rest is masked as usual.
        first_pos = ctx_len - q_len + tl.minimum((tile * BLOCK_M) // GROUP, q_len - 1)
        unmasked_end = kv_start + (tl.minimum(first_pos + 1, kv_end) - kv_start) // BLOCK_N * BLOCK_N
        acc, m_i, l_i = _attend_keys(
            acc, m_i, l_i, q_ptr, q, q_pos, k_cache_ptr, v_cache_ptr, table_row, kv_head, dims, dim_valid, kv_end,
            window, qk_scale, stride_ks, stride_kb, stride_kh, stride_vb, stride_vs, stride_vh, kv_start,
            unmasked_end, PAGE_SIZE=PAGE_SIZE, BLOCK_N=BLOCK_N, DOT_PRECISION=DOT_PRECISION, SLIDING=SLIDING,
            MASKED=False)
    acc, m_i, l_i = _attend_keys(
        acc, m_i, l_i, q_ptr, q, q_pos, k_cache_ptr, v_cache_ptr, table_row, kv_head, dims, dim_valid, kv_end,
        window, qk_scale, stride_ks, stride_kb, stride_kh, stride_vb, stride_vs, stride_vh, unmasked_end, kv_end,
        PAGE_SIZE=PAGE_SIZE, BLOCK_N=BLOCK_N, DOT_PRECISION=DOT_PRECISION, SLIDING=SLIDING, MASKED=True)

    if SPLIT:
        # Partials are indexed [seq, query head, partition]; decode-only batches have one query row per sequence.
        # Every head's partial is written, even for a sequence without a query row (max -inf, sum 0), so the
        # reduce never reads uninitialized memory.
        part_row = (seq * GROUP * tl.num_programs(1) + head).to(tl.int64) * num_partitions + chunk
        head_valid = rows < GROUP
        tl.store(part_max_ptr + part_row, m_i, mask=head_valid)
        tl.store(part_sum_ptr + part_row, l_i, mask=head_valid)
        tl.store(part_acc_ptr + part_row[:, None] * HEAD_DIM + dims[None, :], acc,
                 mask=head_valid[:, None] & dim_valid[None, :])
    else:
        # A tile without real rows (beyond a short sequence's queries) saw no keys; 1 avoids a 0/0 it never stores.
        out = acc / tl.where(row_valid, l_i, 1.0)[:, None]
        o_offs = (q_start + q_row).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & dim_valid[None, :])


@triton.jit
def _reduce_partitions_kernel(
    out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, query_start_loc_ptr,
    stride_ot, stride_oh, num_partitions,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PART_TILE: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    base = (seq * tl.num_programs(1) + head).to(tl.int64) * num_partitions

    # Partitions past the context hold max -inf and sum 0, so their weight exp2(-inf - max) is 0. Both passes walk
    # PART_TILE partitions at a time: the partition count is a runtime value, so one compiled kernel serves all.
    running_max = tl.full([PART_TILE], float("-inf"), dtype=tl.float32)
    for first in range(0, num_partitions, PART_TILE):
        tile_parts = first + tl.arange(0, PART_TILE)
        tile_max = tl.load(part_max_ptr + base + tile_parts, mask=tile_parts < num_partitions, other=float("-inf"))
        running_max = tl.maximum(running_max, tile_max)
    global_max = tl.max(running_max, axis=0)
    # A sequence without a query row has no keys at all; 0 keeps its (unstored) result free of inf - inf.
    global_max = tl.where(global_max == float("-inf"), 0.0, global_max)

    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < HEAD_DIM
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    denom = tl.zeros([PART_TILE], dtype=tl.float32)
    for first in range(0, num_partitions, PART_TILE):
        tile_parts = first + tl.arange(0, PART_TILE)
        tile_valid = tile_parts < num_partitions
        weight = tl.exp2(tl.load(part_max_ptr + base + tile_parts, mask=tile_valid, other=float("-inf")) - global_max)
        denom += weight * tl.load(part_sum_ptr + base + tile_parts, mask=tile_valid, other=0.0)
        part_acc = tl.load(
            part_acc_ptr + (base + tile_parts)[:, None] * HEAD_DIM + dims[None, :],
            mask=tile_valid[:, None] & dim_valid[None, :], other=0.0,
        )
        acc += tl.sum(part_acc * weight[:, None], axis=0)
    has_query = q_len > 0
    out = acc / tl.where(has_query, tl.sum(denom, axis=0), 1.0)
    store_dims = tl.where(has_query, HEAD_DIM, 0)
    tl.store(out_ptr + q_start.to(tl.int64) * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < store_dims)


def use_split_k(
    num_seqs: int, num_kv_heads: int, max_query_len: int, max_context_len: int, device: torch.device,
) -> bool:
    """The split path pays off for decode-only batches with long contexts when the direct path (one program per
    sequence and KV head) would launch too few programs to fill the device. ``KVSERVE_SPLIT_K`` overrides it."""
    if max_query_len != 1:
        return False
    forced = os.environ.get(SPLIT_K_ENV)
    if forced is not None:
        return forced == "1"
    return max_context_len >= SPLIT_MIN_CONTEXT and num_seqs * num_kv_heads < 4 * num_compute_units(device)


def choose_partition_size(num_seqs: int, num_kv_heads: int, max_context_len: int, device: torch.device) -> int:
    """The smallest power-of-two partition (within [64, 512]) that still yields about two programs per SM: batch-1
    decode needs many partitions to use the whole GPU, large batches need few to keep the reduce cheap."""
    target_programs = 2 * num_compute_units(device)
    partitions = -(-target_programs // (num_seqs * num_kv_heads))
    size = triton.next_power_of_2(max(1, -(-max_context_len // partitions)))
    return min(MAX_PARTITION_SIZE, max(MIN_PARTITION_SIZE, size))


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    max_query_len: int | None = None,
    max_context_len: int | None = None,
    split_k: bool | None = None,
    partition_size: int | None = None,
) -> torch.Tensor:
    """Causal paged attention; same contract as ``kernels.reference.paged_attention`` (``window``: a sliding-window
    layer's, None for full attention; ``sinks``: per-head attention sinks ``[Hq]``, or None).

    ``max_query_len`` / ``max_context_len`` size the launch grid. Pass them from host-side values the caller already
    has to avoid a device sync; under CUDA-graph capture pass fixed upper bounds (extra programs exit at once).
    ``split_k``: None picks by :func:`use_split_k`; True requires a decode-only batch (at most one row per sequence).
    ``partition_size``: context positions per split-K partition, a power of two; None picks by
    :func:`choose_partition_size`.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_pages, page_size, num_kv_heads, _ = k_cache.shape
    num_seqs = context_lens.shape[0]
    assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    assert page_size & (page_size - 1) == 0, "block size must be a power of two"
    assert query.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert block_tables.stride(-1) == 1
    out = torch.empty_like(query)
    if num_tokens == 0 or num_seqs == 0:
        return out
    if max_query_len is None or max_context_len is None:
        # One device-to-host copy for both bounds (callers that know them on the host skip it entirely).
        q_max, ctx_max = torch.stack(
            [(query_start_loc[1:] - query_start_loc[:-1]).max().long(), context_lens.max().long()]
        ).tolist()
        max_query_len = q_max if max_query_len is None else max_query_len
        max_context_len = ctx_max if max_context_len is None else max_context_len
    group = num_heads // num_kv_heads
    if window is not None:  # a decode row reads at most `window` keys: what the split path divides
        max_context_len = min(max_context_len, window)
    if split_k is None:
        split_k = use_split_k(num_seqs, num_kv_heads, max_query_len, max_context_len, query.device)
    elif split_k and max_query_len > 1:
        raise ValueError("the split-K path only serves decode-only batches (one query row per sequence)")

    block_d = triton.next_power_of_2(head_dim)
    dot_fp32 = upcast_bf16_dot(query.dtype)
    # fp32 inputs use exact fp32 products; TF32 would lose precision against the reference.
    precision = "ieee" if query.dtype == torch.float32 else "tf32"
    common = dict(
        HEAD_DIM=head_dim, BLOCK_D=block_d, GROUP=group, PAGE_SIZE=page_size,
        DOT_FP32=dot_fp32, DOT_PRECISION=precision, SLIDING=window is not None, SINKS=sinks is not None,
    )
    sinks = out if sinks is None else sinks.float().contiguous()  # unread without SINKS
    strides = (
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
    )
    qk_scale = scale * _LOG2E
    if window is not None and window < 1:
        raise ValueError(f"a sliding window holds at least one position, got {window}")
    window = window or 0

    if not split_k:
        rows = max_query_len * group
        block_m = 16 if rows <= 16 else (32 if rows <= 32 else 64)
        block_n = 64 if block_d <= 64 else 32
        grid = (num_seqs, num_kv_heads, triton.cdiv(rows, block_m))
        _paged_attention_kernel[grid](
            query, k_cache, v_cache, out, sinks, block_tables, context_lens, query_start_loc,
            out, out, out,  # partial buffers: unused on the direct path
            qk_scale, window, *strides, 1, 0,  # partition count and size: read only when SPLIT
            BLOCK_M=block_m, BLOCK_N=block_n, SPLIT=False, **common,
        )
        return out

    if partition_size is None:
        partition_size = choose_partition_size(num_seqs, num_kv_heads, max_context_len, query.device)
    assert partition_size & (partition_size - 1) == 0, "partition_size must be a power of two"
    # A key tile covers a whole partition or divides it. Partitions under 16 keys (tests) take one 16-key tile,
    # masked to the partition: Triton's GPU backend refuses a tl.dot with K < 16 (< 8 for fp32), as p @ v would be.
    block_n = max(16, min(64, partition_size))
    num_partitions = max(1, triton.cdiv(max_context_len, partition_size))
    part_acc = torch.empty(num_seqs, num_heads, num_partitions, head_dim, dtype=torch.float32, device=query.device)
    part_max = torch.empty(num_seqs, num_heads, num_partitions, dtype=torch.float32, device=query.device)
    part_sum = torch.empty_like(part_max)
    _paged_attention_kernel[(num_seqs, num_kv_heads, num_partitions)](
        query, k_cache, v_cache, out, sinks, block_tables, context_lens, query_start_loc,
        part_acc, part_max, part_sum,
        qk_scale, window, *strides, num_partitions, partition_size,
        BLOCK_M=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n, SPLIT=True, **common,
    )
    reduce_partitions(out, part_acc, part_max, part_sum, query_start_loc)
    return out


def reduce_partitions(
    out: torch.Tensor, part_acc: torch.Tensor, part_max: torch.Tensor, part_sum: torch.Tensor,
    query_start_loc: torch.Tensor,
) -> None:
    """Merge split-K partials ``part_acc`` ``[B, H, P, D]`` (unnormalized, fp32) with their running max and sum
    ``[B, H, P]`` into ``out[query_start_loc[b], h]``; sequences without a query row are skipped."""
    num_seqs, num_heads, num_partitions, head_dim = part_acc.shape
    _reduce_partitions_kernel[(num_seqs, num_heads)](
        out, part_acc, part_max, part_sum, query_start_loc,
        out.stride(0), out.stride(1), num_partitions,
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), PART_TILE=16,
    )


__all__ = ["paged_attention", "reduce_partitions", "use_split_k", "choose_partition_size", "SPLIT_K_ENV"]
