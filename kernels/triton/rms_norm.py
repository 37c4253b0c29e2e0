"""Triton RMSNorm with an optional fused residual add (``kernels.reference.rms_norm``)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.utils import row_view

# Elements one program normalizes: short rows (per-head q/k norms, 128 wide) are packed several to a program
# instead of launching one tiny program per row.
_TILE_ELEMENTS = 4096


@triton.jit
def _row_offsets(rows, heads, stride_outer, stride_inner):
    """Element offset of each row's start; a row is (outer index, inner index) = divmod(row, heads)."""
    return (rows // heads) * stride_outer + (rows % heads) * stride_inner


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    num_rows, heads, stride_xo, stride_xi, stride_ro, stride_ri, stride_o, stride_res_o, eps,
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]
    cols = tl.arange(0, BLOCK)[None, :]
    mask = (rows < num_rows) & (cols < HIDDEN)
    x = tl.load(x_ptr + _row_offsets(rows, heads, stride_xo, stride_xi) + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # The sum is rounded to the activation dtype before the norm, exactly as the unfused ``x + residual``.
        residual = tl.load(residual_ptr + _row_offsets(rows, heads, stride_ro, stride_ri) + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + rows * stride_res_o + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=1) / HIDDEN + eps)[:, None]
    weight = tl.load(weight_ptr + cols, mask=cols < HIDDEN, other=0.0).to(tl.float32)
    if ZERO_CENTERED:  # gain 1 + weight, one rounding at the end
        normed = xf * inv_rms
        weight = weight + 1.0
    else:  # the reference rounds the normalized row to the activation dtype before scaling by the weight
        normed = (xf * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + rows * stride_o + cols, (normed * weight).to(out_ptr.dtype.element_ty), mask=mask)


def _as_rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """``x`` addressed as rows of its last dim: (tensor, rows per outer index, outer stride, inner stride).

    A 3-D input such as per-head q ``[T, H, D]`` sliced out of a fused qkv projection is read in place through its
    two strides rather than copied to be contiguous first.
    """
    if x.dim() == 3 and x.stride(-1) == 1:
        return x, x.shape[1], x.stride(0), x.stride(1)
    x2d = row_view(x)
    return x2d, 1, x2d.stride(0), 0


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    zero_centered: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim, in fp32. With ``residual``: returns ``(norm(x + residual), x + residual)``;
    ``zero_centered``: the gain is ``1 + weight`` (as ``kernels.reference.rms_norm``)."""
    hidden = x.shape[-1]
    x_rows, heads, stride_xo, stride_xi = _as_rows(x)
    num_rows = x.numel() // hidden if hidden else 0
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype
        res_rows, res_heads, stride_ro, stride_ri = _as_rows(residual)
        assert res_heads == heads
        residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    else:
        # unused: HAS_RESIDUAL=False compiles the residual path away
        res_rows, stride_ro, stride_ri, residual_out = x_rows, stride_xo, stride_xi, out
    if num_rows > 0:
        block = triton.next_power_of_2(hidden)
        rows = max(1, _TILE_ELEMENTS // block)  # fixed per width: one compiled variant whatever the batch
        _rms_norm_kernel[(triton.cdiv(num_rows, rows),)](
            x_rows, res_rows, weight, out, residual_out,
            num_rows, heads, stride_xo, stride_xi, stride_ro, stride_ri, hidden, hidden, eps,
            HIDDEN=hidden, BLOCK=block, ROWS=rows, HAS_RESIDUAL=residual is not None, ZERO_CENTERED=zero_centered,
        )
    return out if residual is None else (out, residual_out)
