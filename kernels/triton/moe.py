"""Triton fused mixture-of-experts (``kernels.reference.fused_moe``): pairs sorted by expert, two grouped GEMMs.

Every (token, k) pair goes to expert ``topk_ids[token, k]``. `align_by_expert` sorts the pairs by expert and pads each
expert's run to a multiple of ``BLOCK_M``, so every ``BLOCK_M``-row tile of the sorted order belongs to one expert.
One launch multiplies each tile by its expert's gate_up weights, SiLU-and-mul follows, and a second launch multiplies
by the down weights and the routing weight; each token's top-k rows are then summed. Pairs with expert id -1 (held by
another rank under expert parallelism) sort into a last run that no tile computes; their rows stay zero.

Nothing here waits for the device: the sorted order has at most ``T*K + E*(BLOCK_M - 1)`` rows, the grid is sized
for that bound, and tiles past the real padded length exit at once. The launches are therefore CUDA-graph safe.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.reference import expert_activation
from kernels.triton.activation import silu_and_mul
from kernels.triton.utils import upcast_bf16_dot


def align_by_expert(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(sorted_pairs, tile_experts, num_padded)`` for the grouped GEMMs.

    ``sorted_pairs`` ``[T*K + E*(block_m - 1)]`` int32: flat pair indices (``token * K + k``) grouped by expert, each
    expert's run padded to a multiple of ``block_m`` with ``T*K`` (no pair); ``tile_experts`` the expert of each
    ``block_m``-row tile (meaningless past ``num_padded``); ``num_padded`` ``[1]`` the padded length actually used.
    Pairs of expert -1 form a run after the last expert's, past ``num_padded``.
    """
    flat = topk_ids.flatten().long()
    flat = flat.masked_fill(flat < 0, num_experts)  # the skipped pairs' run comes last
    num_pairs, device = flat.numel(), flat.device
    runs = num_experts + 1
    # scatter_add, not bincount: bincount reads its maximum back to the host on CUDA.
    counts = torch.zeros(runs, dtype=torch.long, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    order = flat.argsort(stable=True)
    experts = flat[order]
    rank = torch.arange(num_pairs, device=device) - (counts.cumsum(0) - counts)[experts]
    capacity = num_pairs + runs * (block_m - 1)
    sorted_pairs = torch.full((capacity,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs[(padded_end - padded)[experts] + rank] = order.to(torch.int32)
    tile_starts = torch.arange(0, capacity, block_m, device=device)
    tile_experts = torch.searchsorted(padded_end, tile_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_pairs, tile_experts.to(torch.int32), padded_end[num_experts - 1 : num_experts]


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, b_ptr, c_ptr, weights_ptr, sorted_pairs_ptr, tile_experts_ptr, num_padded_ptr,
    num_pairs, N, K,
    stride_am, stride_be, stride_bn, stride_bk, stride_cm,
    PAIRS_PER_A_ROW: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """``c[pair] = a[pair // PAIRS_PER_A_ROW] @ b[expert].T`` (times ``weights[pair]`` when MUL_WEIGHT) for the pairs
    of one sorted tile and ``BLOCK_N`` output columns."""
    tile = tl.program_id(0)
    if tile * BLOCK_M >= tl.load(num_padded_ptr):
        return
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + rows)
    row_valid = pairs < num_pairs
    a_rows = (pairs // PAIRS_PER_A_ROW).to(tl.int64)
    expert = tl.load(tile_experts_ptr + tile).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_valid = cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        k_valid = ks < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + ks[None, :],
                    mask=row_valid[:, None] & k_valid[None, :], other=0.0)
        b = tl.load(b_ptr + expert * stride_be + cols[None, :] * stride_bn + ks[:, None] * stride_bk,
                    mask=k_valid[:, None] & col_valid[None, :], other=0.0)
        if DOT_FP32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc += tl.dot(a, b, input_precision=DOT_PRECISION)
    if MUL_WEIGHT:
        acc = acc * tl.load(weights_ptr + pairs, mask=row_valid, other=0.0).to(tl.float32)[:, None]
    tl.store(c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + cols[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=row_valid[:, None] & col_valid[None, :])


def choose_block_m(num_pairs: int, num_experts: int) -> int:
    """Tile rows by the average pairs per expert: small tiles waste little padding on decode-sized batches."""
    average = num_pairs / num_experts
    return 16 if average <= 16 else (32 if average <= 32 else 64)


def _grouped_gemm(
    a: torch.Tensor, weights: torch.Tensor, out: torch.Tensor, alignment: tuple, pairs_per_a_row: int,
    topk_weights: torch.Tensor | None, block_m: int,
) -> None:
    sorted_pairs, tile_experts, num_padded = alignment
    n, k = weights.shape[1], weights.shape[2]
    block_k = 32 if a.dtype == torch.float32 else 64
    grid = (triton.cdiv(sorted_pairs.numel(), block_m), triton.cdiv(n, 64))
    _grouped_gemm_kernel[grid](
        a, weights, out, topk_weights if topk_weights is not None else out, sorted_pairs, tile_experts, num_padded,
        out.shape[0], n, k,
        a.stride(0), weights.stride(0), weights.stride(1), weights.stride(2), out.stride(0),
        PAIRS_PER_A_ROW=pairs_per_a_row, MUL_WEIGHT=topk_weights is not None,
        BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=block_k, DOT_FP32=upcast_bf16_dot(a.dtype),
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
    )


def fused_moe(
    hidden: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    swiglu_limit: float | None = None,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    swiglu_alpha: float | None = None,
) -> torch.Tensor:
    """The routed experts' weighted sum; same contract as ``kernels.reference.fused_moe``. The biases (gpt-oss) are
    added by the pairs' experts around the two GEMMs, the down bias weighted like its expert's output."""
    num_tokens, top_k = topk_ids.shape
    num_experts, hidden_size = gate_up_proj.shape[0], hidden.shape[1]
    assert hidden.stride(-1) == 1 and gate_up_proj.stride(-1) == 1 and down_proj.stride(-1) == 1
    if num_tokens == 0:
        return hidden.new_zeros(0, hidden_size)
    num_pairs = num_tokens * top_k
    block_m = choose_block_m(num_pairs, num_experts)
    alignment = align_by_expert(topk_ids, num_experts, block_m)
    gate_up = hidden.new_empty(num_pairs, gate_up_proj.shape[1])
    _grouped_gemm(hidden, gate_up_proj, gate_up, alignment, top_k, None, block_m)
    pair_experts = topk_ids.flatten().long().clamp(min=0)  # a skipped pair's bias rows are masked below
    if gate_up_bias is not None:
        gate_up += gate_up_bias[pair_experts].to(gate_up.dtype)
    down = hidden.new_zeros(num_pairs, hidden_size)  # zeros: the rows of skipped (-1) pairs are never written
    weights = topk_weights.float().flatten()
    _grouped_gemm(expert_activation(gate_up, swiglu_limit, swiglu_alpha, silu_and_mul), down_proj, down, alignment, 1,
                  weights, block_m)
    if down_bias is not None:
        held = (topk_ids.flatten() >= 0).float()
        down += (down_bias[pair_experts].float() * (weights * held)[:, None]).to(down.dtype)
    return down.view(num_tokens, top_k, hidden_size).sum(1)
