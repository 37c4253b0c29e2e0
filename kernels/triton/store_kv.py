"""Triton kernel writing the new tokens' K and V into their pages (``kernels.reference.store_kv``)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.fp8_cast import software_fp8_rounding, to_e4m3


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    NUM_KV_HEADS: tl.constexpr, K_DIM: tl.constexpr, V_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_KD: tl.constexpr, BLOCK_VD: tl.constexpr, PAGE_SIZE: tl.constexpr,
    FP8_PAGES: tl.constexpr, SOFTWARE_ROUNDING: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    page = slot // PAGE_SIZE
    slot_in_page = slot % PAGE_SIZE
    heads = tl.arange(0, BLOCK_H)
    k_dims = tl.arange(0, BLOCK_KD)
    v_dims = tl.arange(0, BLOCK_VD)
    # Padding tokens (slot < 0, e.g. CUDA-graph filler rows) write nothing: no head is in range for them.
    # (Folding the scalar into the bound also sidesteps the interpreter rejecting `tensor & scalar` masks.)
    num_heads = tl.where(slot >= 0, NUM_KV_HEADS, 0)
    k_mask = (heads[:, None] < num_heads) & (k_dims[None, :] < K_DIM)
    v_mask = (heads[:, None] < num_heads) & (v_dims[None, :] < V_DIM)
    src = token.to(tl.int64)
    k = tl.load(key_ptr + src * stride_kt + heads[:, None] * stride_kh + k_dims[None, :], mask=k_mask)
    v = tl.load(value_ptr + src * stride_vt + heads[:, None] * stride_vh + v_dims[None, :], mask=v_mask)
    if FP8_PAGES:
        k = to_e4m3(k.to(tl.float32), SOFTWARE_ROUNDING)
        v = to_e4m3(v.to(tl.float32), SOFTWARE_ROUNDING)
    tl.store(k_cache_ptr + page * stride_kcb + slot_in_page * stride_kcs + heads[:, None] * stride_kch
             + k_dims[None, :], k.to(k_cache_ptr.dtype.element_ty), mask=k_mask)
    tl.store(v_cache_ptr + page * stride_vcb + slot_in_page * stride_vcs + heads[:, None] * stride_vch
             + v_dims[None, :], v.to(v_cache_ptr.dtype.element_ty), mask=v_mask)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key`` ``[T, Hkv, Dk]`` / ``value`` ``[T, Hkv, Dv]`` into the pages at ``slot_mapping`` ``[T]``; slots
    < 0 are padding. The pages may be strided views (MLA's latent and rotary key share one page tensor). FP8 pages
    get saturated, nearest-even e4m3 values (scale 1.0), as in the reference."""
    assert k_cache.dtype == v_cache.dtype
    num_tokens, num_kv_heads, k_dim = key.shape
    v_dim = value.shape[-1]
    page_size = k_cache.shape[1]
    assert value.shape[:2] == key.shape[:2] and slot_mapping.shape == (num_tokens,)
    assert key.stride(-1) == 1 and value.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, K_DIM=k_dim, V_DIM=v_dim, BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_KD=triton.next_power_of_2(k_dim), BLOCK_VD=triton.next_power_of_2(v_dim), PAGE_SIZE=page_size,
        FP8_PAGES=k_cache.dtype == torch.float8_e4m3fn, SOFTWARE_ROUNDING=software_fp8_rounding(),
    )
