"""Block-scaled FP8 GEMM in Triton (``kernels.reference.fp8_block_linear``): ``x @ W.T + bias`` with W in e4m3.

The weight ``[N, K]`` carries one float32 ``scale_inv`` per ``group_n x group_k`` block (DeepSeek-V3 / Qwen3-FP8
checkpoints: 128 x 128; ``group_n`` 1 when a fused layer keeps one scale row per output row). Activations are
quantized on the fly, per token and group of ``group_k`` columns, inside the K loop: each step loads one group of
``x``, takes its per-row absolute maximum, quantizes it to e4m3 and runs an fp8 x fp8 ``tl.dot`` whose fp32 partial
sum is multiplied by both scales before it joins the accumulator. Per-group promotion into fp32 is also what keeps
the precision of Hopper's fp8 tensor-core accumulation in check (DeepSeek-V3 report, section 3.3.2).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.fp8_cast import software_fp8_rounding, to_e4m3
from kernels.triton.utils import row_view

# Triton's NVIDIA backend refuses an 8-bit tl.dot with K < 32 ("K >= 32"); the interpreter does not check it.
# A smaller group is padded with masked (zero) lanes.
MIN_FP8_DOT_K = 32


@triton.jit
def _fp8_block_gemm_kernel(
    x_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_wsn, stride_om,
    GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, SOFTWARE_ROUNDING: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_valid = rows < M
    col_valid = cols < N
    lanes = tl.arange(0, BLOCK_K)  # BLOCK_K: GROUP_K rounded up to a power of two, at least 32
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + cols.to(tl.int64)[None, :] * stride_wn
    w_scale_cols = w_scale_ptr + (cols // GROUP_N).to(tl.int64) * stride_wsn

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for group in range(0, tl.cdiv(K, GROUP_K)):
        k = group * GROUP_K + lanes
        k_valid = (lanes < GROUP_K) & (k < K)
        x = tl.load(x_rows + k[None, :], mask=row_valid[:, None] & k_valid[None, :], other=0.0).to(tl.float32)
        # As kernels.reference, in IEEE arithmetic on both sides: Triton's plain `/` is an approximate division on
        # NVIDIA GPUs, so the two per-row divisions are div_rn and each element gets one (exact-rounding) multiply.
        x_scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12), 448.0)
        x_fp8 = to_e4m3(x * tl.math.div_rn(1.0, x_scale)[:, None], SOFTWARE_ROUNDING)
        w = tl.load(w_cols + k[:, None], mask=k_valid[:, None] & col_valid[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        w_scale = tl.load(w_scale_cols + group, mask=col_valid, other=0.0)
        acc += tl.dot(x_fp8, w) * (x_scale[:, None] * w_scale[None, :])
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_valid, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & col_valid[None, :])


def fp8_block_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    block_size: tuple[int, int],
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W.T + bias`` in ``x``'s dtype; same contract as ``kernels.reference.fp8_block_linear``."""
    num_out, width = weight.shape
    group_n, group_k = block_size
    assert weight.dtype == torch.float8_e4m3fn and weight.stride(-1) == 1 and weight_scale_inv.stride(-1) == 1
    assert x.shape[-1] == width, f"x has {x.shape[-1]} columns, the weight {width}"
    assert weight_scale_inv.shape == (-(-num_out // group_n), -(-width // group_k)), "scale grid does not fit W"
    rows = row_view(x)
    num_rows = rows.shape[0]
    out = torch.empty(num_rows, num_out, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out.view(*x.shape[:-1], num_out)
    # Decode batches are a few rows: a 16-row tile wastes the least, and narrower column tiles give the (weight
    # bandwidth bound) launch more programs. Prefill takes 64 x 128 tiles.
    block_m = 16 if num_rows <= 16 else (32 if num_rows <= 32 else 64)
    block_n = 64 if num_rows <= 16 or num_out <= 64 else 128
    grid = (triton.cdiv(num_rows, block_m), triton.cdiv(num_out, block_n))
    _fp8_block_gemm_kernel[grid](
        rows, weight, weight_scale_inv, out if bias is None else bias, out,
        num_rows, num_out, width,
        rows.stride(0), weight.stride(0), weight_scale_inv.stride(0), out.stride(0),
        GROUP_N=group_n, GROUP_K=group_k,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=max(MIN_FP8_DOT_K, triton.next_power_of_2(group_k)),
        HAS_BIAS=bias is not None, SOFTWARE_ROUNDING=software_fp8_rounding(),
    )
    return out.view(*x.shape[:-1], num_out)
