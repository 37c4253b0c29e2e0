"""Triton neox-style rotary embedding (``kernels.reference.rotary_embedding``)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(src_ptr, dst_ptr, token, stride_t, stride_h, stride_dt, stride_dh, cos, sin,
                  NUM_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_HALF)
    mask = (heads[:, None] < NUM_HEADS) & (dims[None, :] < HALF)
    src = src_ptr + token * stride_t + heads[:, None] * stride_h + dims[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = dst_ptr + token * stride_dt + heads[:, None] * stride_dh + dims[None, :]
    tl.store(dst, (x1 * cos - x2 * sin).to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr, q_ptr, k_ptr, q_out_ptr, k_out_ptr, cos_sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh, stride_cs,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)
    # One cos/sin row serves every query and key head of the token.
    cos = tl.load(cos_sin_ptr + pos * stride_cs + dims, mask=dims < HALF, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + dims, mask=dims < HALF, other=0.0).to(tl.float32)[None, :]
    _rotate_heads(q_ptr, q_out_ptr, token, stride_qt, stride_qh, stride_qot, stride_qoh, cos, sin,
                  NUM_Q_HEADS, HALF, BLOCK_QH, BLOCK_HALF)
    _rotate_heads(k_ptr, k_out_ptr, token, stride_kt, stride_kh, stride_kot, stride_koh, cos, sin,
                  NUM_KV_HEADS, HALF, BLOCK_KH, BLOCK_HALF)


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style RoPE on ``query`` ``[T, Hq, D]`` and ``key`` ``[T, Hkv, D]``; returns new tensors.

    ``cos_sin_cache`` is ``[max_positions, D]``: cos in the first half, sin in the second.
    """
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    assert cos_sin_cache.shape[-1] == head_dim and head_dim % 2 == 0, "rotary dim must equal the head dim"
    assert query.stride(-1) == 1 and key.stride(-1) == 1 and cos_sin_cache.stride(-1) == 1
    q_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    k_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    if num_tokens > 0:
        half = head_dim // 2
        _rotary_kernel[(num_tokens,)](
            positions, query, key, q_out, k_out, cos_sin_cache,
            query.stride(0), query.stride(1), key.stride(0), key.stride(1),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos_sin_cache.stride(0),
            NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HALF=half,
            BLOCK_QH=triton.next_power_of_2(num_q_heads), BLOCK_KH=triton.next_power_of_2(num_kv_heads),
            BLOCK_HALF=triton.next_power_of_2(half),
        )
    return q_out, k_out
