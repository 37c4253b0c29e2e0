"""DeepSeek-V4's attention with sinks over gathered slots in Triton (``kernels.reference.compressed.sink_attention``).

One program per (query row, tile of heads) walks the row's slots in each source (the window's tokens, then the
compressed entries) with an online softmax, reading each chosen K = V row once for all heads of the tile. The sink
starts the softmax: the running max is the sink's logit and the running sum its exp (1), so it takes probability
without adding a value. Gated window pooling (``pool_windows``) has no kernel yet: the Triton op set runs the
reference.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.triton.utils import upcast_bf16_dot

BLOCK_H = 16  # heads per program: the smallest tile tl.dot takes
_LOG2E = 1.0 / math.log(2.0)


@triton.jit
def _attend_slots(q, m_i, l_i, acc, cache_ptr, slots_ptr, row, num_slots, stride_c, stride_s, qk_scale, dims,
                  dim_valid, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """The online softmax over one source's slots of ``row`` (-1: none), continued from ``(m_i, l_i, acc)``."""
    for start in range(0, num_slots, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        slot = tl.load(slots_ptr + row.to(tl.int64) * stride_s + j, mask=j < num_slots, other=-1).to(tl.int64)
        chosen = slot >= 0
        k = tl.load(cache_ptr + tl.maximum(slot, 0)[:, None] * stride_c + dims[None, :],
                    mask=chosen[:, None] & dim_valid[None, :], other=0.0).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        s = tl.where(chosen[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(k.dtype), k, input_precision=DOT_PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _sink_attention_kernel(
    q_ptr, out_ptr, sinks_ptr, cache_a_ptr, slots_a_ptr, cache_b_ptr, slots_b_ptr,
    qk_scale, num_heads, num_a, num_b,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_ca, stride_sa, stride_cb, stride_sb,
    DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    row = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_valid = heads < num_heads
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < DIM
    q = tl.load(q_ptr + row.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                mask=head_valid[:, None] & dim_valid[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    m_i = tl.load(sinks_ptr + heads, mask=head_valid, other=0.0).to(tl.float32) * 1.4426950408889634  # log2(e)
    l_i = tl.full([BLOCK_H], 1.0, dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    m_i, l_i, acc = _attend_slots(q, m_i, l_i, acc, cache_a_ptr, slots_a_ptr, row, num_a, stride_ca, stride_sa,
                                  qk_scale, dims, dim_valid, BLOCK_N, DOT_PRECISION)
    m_i, l_i, acc = _attend_slots(q, m_i, l_i, acc, cache_b_ptr, slots_b_ptr, row, num_b, stride_cb, stride_sb,
                                  qk_scale, dims, dim_valid, BLOCK_N, DOT_PRECISION)
    tl.store(out_ptr + row.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + dims[None, :],
             (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=head_valid[:, None] & dim_valid[None, :])


def sink_attention(
    query: torch.Tensor,
    sources: list[tuple[torch.Tensor, torch.Tensor]],
    sinks: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Same contract as ``kernels.reference.compressed.sink_attention``, for one or two sources."""
    num_rows, num_heads, dim = query.shape
    assert 1 <= len(sources) <= 2 and query.stride(-1) == 1
    assert all(flat.stride(-1) == 1 and slots.stride(-1) == 1 for flat, slots in sources)
    out = torch.empty_like(query)
    if num_rows == 0:
        return out
    (cache_a, slots_a), (cache_b, slots_b) = sources[0], sources[-1]
    num_b = slots_b.shape[1] if len(sources) == 2 else 0
    block_d = max(16, triton.next_power_of_2(dim))
    _sink_attention_kernel[(num_rows, triton.cdiv(num_heads, BLOCK_H))](
        query, out, sinks.float().contiguous(), cache_a, slots_a, cache_b, slots_b,
        scale * _LOG2E, num_heads, slots_a.shape[1], num_b,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        cache_a.stride(0), slots_a.stride(0), cache_b.stride(0), slots_b.stride(0),
        DIM=dim, BLOCK_D=block_d, BLOCK_H=BLOCK_H, BLOCK_N=16 if block_d >= 512 else 32,
        DOT_FP32=upcast_bf16_dot(query.dtype), DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
    )
    return out
