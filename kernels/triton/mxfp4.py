"""Triton MXFP4 mixture-of-experts (``kernels.reference.mxfp4.fused_moe_mxfp4``): the expert GEMMs read packed
weights (two e2m1 codes a byte, one UE8M0 scale per 32 values of a row) and unpack each tile in registers, so the
experts stay at 4.25 bits a value in memory.

Pairs are grouped by expert as in ``kernels.triton.moe`` (`align_by_expert`: every ``BLOCK_M``-row tile of the sorted
order belongs to one expert; the launches are CUDA-graph safe). A K step loads ``BLOCK_K / 2`` bytes of each of
``BLOCK_N`` weight rows once: their low nibbles are the even columns and their high nibbles the odd ones, so the
activation tile is read as its even and odd columns and two dots (one per nibble) replace interleaving the codes.
The first launch computes, for ``BLOCK_N`` columns of the intermediate dim, the gate rows and the up rows together,
adds their biases and applies the activation (gpt-oss' clamped SwiGLU, or SiLU-and-mul) before one store; the second
multiplies by the down weights, adds the down bias and scales by the routing weight. Accumulation is fp32; the
unpacked tile is cast to the activation dtype first (exact for every code times a scale in bf16's range), as the
reference casts the unpacked expert.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.moe import align_by_expert, choose_block_m
from kernels.triton.utils import upcast_bf16_dot


@triton.jit
def _e2m1(codes):
    """fp32 values of 4-bit e2m1 codes: bit 3 the sign, bits 1-2 the exponent, bit 0 the mantissa."""
    exponent = (codes >> 1) & 3
    mantissa = (codes & 1).to(tl.float32)
    magnitude = tl.where(exponent == 0, 0.5 * mantissa,
                         (1.0 + 0.5 * mantissa) * (1 << exponent).to(tl.float32) * 0.5)
    return tl.where((codes & 8) != 0, -magnitude, magnitude)


@triton.jit
def _packed_dot(acc, a_even, a_odd, w_ptrs, s_ptrs, mask, DOT_PRECISION: tl.constexpr):
    """``acc`` plus the activation columns times one packed weight tile: bytes ``[BLOCK_K / 2, BLOCK_N]`` at
    ``w_ptrs`` and their UE8M0 scales at ``s_ptrs`` (one per byte, 16 bytes sharing each)."""
    packed = tl.load(w_ptrs, mask=mask, other=0).to(tl.int32)
    # 2^(s - 127) built from its bits: exact, and no exp2 approximation on the GPU (s = 0, 2^-127, reads as 0)
    scale = (tl.load(s_ptrs, mask=mask, other=0).to(tl.int32) << 23).to(tl.float32, bitcast=True)
    low = (_e2m1(packed & 15) * scale).to(a_even.dtype)
    high = (_e2m1(packed >> 4) * scale).to(a_even.dtype)
    acc += tl.dot(a_even, low, input_precision=DOT_PRECISION)
    acc += tl.dot(a_odd, high, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _mxfp4_moe_kernel(
    a_ptr, w_ptr, s_ptr, bias_ptr, weights_ptr, out_ptr, sorted_pairs_ptr, tile_experts_ptr, num_padded_ptr,
    num_pairs, N, K, limit, alpha,
    stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_be, stride_om,
    PAIRS_PER_A_ROW: tl.constexpr, GATED: tl.constexpr, OAI_SWIGLU: tl.constexpr, HAS_LIMIT: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """For the pairs of one sorted tile and ``BLOCK_N`` output columns: GATED, ``act(a @ gate.T, a @ up.T)`` with the
    gate rows at ``cols`` and the up rows at ``N + cols`` of the expert's weight; else ``(a @ w.T + bias) * weight``
    (the routing weight of each pair)."""
    tile = tl.program_id(0)
    if tile * BLOCK_M >= tl.load(num_padded_ptr):
        return
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + rows)
    row_valid = pairs < num_pairs
    a_rows = a_ptr + (pairs // PAIRS_PER_A_ROW).to(tl.int64)[:, None] * stride_am
    expert = tl.load(tile_experts_ptr + tile).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_valid = cols < N
    w_rows = w_ptr + expert * stride_we + cols.to(tl.int64)[None, :] * stride_wn
    s_rows = s_ptr + expert * stride_se + cols.to(tl.int64)[None, :] * stride_sn
    up_offset_w = N.to(tl.int64) * stride_wn
    up_offset_s = N.to(tl.int64) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    row_bytes = K // 2
    for start in range(0, row_bytes, BLOCK_K // 2):
        byte = start + tl.arange(0, BLOCK_K // 2)
        byte_valid = byte < row_bytes
        a_mask = row_valid[:, None] & byte_valid[None, :]
        a_even = tl.load(a_rows + 2 * byte[None, :], mask=a_mask, other=0.0)
        a_odd = tl.load(a_rows + 2 * byte[None, :] + 1, mask=a_mask, other=0.0)
        if DOT_FP32:
            a_even = a_even.to(tl.float32)
            a_odd = a_odd.to(tl.float32)
        w_mask = byte_valid[:, None] & col_valid[None, :]
        acc = _packed_dot(acc, a_even, a_odd, w_rows + byte[:, None], s_rows + (byte // 16)[:, None], w_mask,
                          DOT_PRECISION)
        if GATED:
            acc_up = _packed_dot(acc_up, a_even, a_odd, w_rows + up_offset_w + byte[:, None],
                                 s_rows + up_offset_s + (byte // 16)[:, None], w_mask, DOT_PRECISION)
    bias_row = bias_ptr + expert * stride_be + cols
    if HAS_BIAS:
        acc += tl.load(bias_row, mask=col_valid, other=0.0).to(tl.float32)[None, :]
    if GATED:
        if HAS_BIAS:
            acc_up += tl.load(bias_row + N, mask=col_valid, other=0.0).to(tl.float32)[None, :]
        gate, up = acc, acc_up
        if HAS_LIMIT:
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
        if OAI_SWIGLU:
            out = (up + 1.0) * gate * tl.sigmoid(alpha * gate)
        else:
            out = gate * tl.sigmoid(gate) * up
    else:
        out = acc * tl.load(weights_ptr + pairs, mask=row_valid, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + pairs.to(tl.int64)[:, None] * stride_om + cols[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_valid[:, None] & col_valid[None, :])


def _launch(a: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
            out: torch.Tensor, topk_weights: torch.Tensor | None, alignment: tuple, pairs_per_a_row: int,
            block_m: int, swiglu_limit: float | None = None, swiglu_alpha: float | None = None) -> None:
    """One grouped GEMM over packed ``blocks`` ``[E, rows, K / 2]``: gated (``topk_weights`` None; ``rows`` = 2 x
    ``out``'s columns) or weighted."""
    sorted_pairs, tile_experts, num_padded = alignment
    gated = topk_weights is None
    n, k = out.shape[1], 2 * blocks.shape[2]
    block_k = 32 if a.dtype == torch.float32 else 64  # a multiple of the 32-value scale groups
    grid = (triton.cdiv(sorted_pairs.numel(), block_m), triton.cdiv(n, 64))
    _mxfp4_moe_kernel[grid](
        a, blocks, scales, bias if bias is not None else out, topk_weights if not gated else out, out,
        sorted_pairs, tile_experts, num_padded,
        out.shape[0], n, k, float(swiglu_limit or 0.0), float(swiglu_alpha or 0.0),
        a.stride(0), blocks.stride(0), blocks.stride(1), scales.stride(0), scales.stride(1),
        bias.stride(0) if bias is not None else 0, out.stride(0),
        PAIRS_PER_A_ROW=pairs_per_a_row, GATED=gated, OAI_SWIGLU=swiglu_alpha is not None,
        HAS_LIMIT=swiglu_limit is not None, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=block_k, DOT_FP32=upcast_bf16_dot(a.dtype),
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
    )


def fused_moe_mxfp4(
    hidden: torch.Tensor,
    gate_up_blocks: torch.Tensor,
    gate_up_scales: torch.Tensor,
    down_blocks: torch.Tensor,
    down_scales: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    swiglu_limit: float | None = None,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    swiglu_alpha: float | None = None,
) -> torch.Tensor:
    """The routed experts' weighted sum over packed weights; same contract as
    ``kernels.reference.mxfp4.fused_moe_mxfp4``."""
    num_tokens, top_k = topk_ids.shape
    num_experts, hidden_size = gate_up_blocks.shape[0], hidden.shape[1]
    inter = gate_up_blocks.shape[1] // 2
    assert hidden.stride(-1) == 1 and gate_up_blocks.dtype == down_blocks.dtype == torch.uint8
    assert all(t.stride(-1) == 1 for t in (gate_up_blocks, gate_up_scales, down_blocks, down_scales))
    assert 2 * gate_up_blocks.shape[2] == hidden_size and 2 * down_blocks.shape[2] == inter, "packed shapes"
    assert hidden_size % 32 == 0 and inter % 32 == 0, "MXFP4 rows are whole groups of 32 values"
    if num_tokens == 0:
        return hidden.new_zeros(0, hidden_size)
    num_pairs = num_tokens * top_k
    block_m = choose_block_m(num_pairs, num_experts)
    alignment = align_by_expert(topk_ids, num_experts, block_m)
    activated = hidden.new_empty(num_pairs, inter)  # rows of pairs held elsewhere (-1) are never written nor read
    _launch(hidden, gate_up_blocks, gate_up_scales, gate_up_bias, activated, None, alignment, top_k, block_m,
            swiglu_limit, swiglu_alpha)
    down = torch.zeros(num_pairs, hidden_size, dtype=torch.float32, device=hidden.device)
    _launch(activated, down_blocks, down_scales, down_bias, down, topk_weights.float().flatten(), alignment, 1,
            block_m)
    return down.view(num_tokens, top_k, hidden_size).sum(1).to(hidden.dtype)
