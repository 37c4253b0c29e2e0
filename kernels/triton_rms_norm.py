"""Triton RMSNorm with an optional fused residual add (``kernels.reference.rms_norm``)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_utils import row_view

# Elements one program normalizes: short rows (per-head q/k norms, 128 wide) are packed several to a program
# instead of launching one tiny program per row.
_TILE_ELEMENTS = 4096


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    num_rows, stride_x, stride_r, stride_o, stride_ro, eps,
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]
    cols = tl.arange(0, BLOCK)[None, :]
    mask = (rows < num_rows) & (cols < HIDDEN)
    x = tl.load(x_ptr + rows * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # The sum is rounded to the activation dtype before the norm, exactly as the unfused ``x + residual``.
        residual = tl.load(residual_ptr + rows * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + rows * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=1) / HIDDEN + eps)[:, None]
    # The reference rounds the normalized row to the activation dtype before scaling by the weight.
    normed = (xf * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=cols < HIDDEN, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows * stride_o + cols, (normed * weight).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim, in fp32. With ``residual``: returns ``(norm(x + residual), x + residual)``."""
    hidden = x.shape[-1]
    x2d = row_view(x)
    num_rows = x2d.shape[0]
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    out2d = out.view(-1, hidden)
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype
        res2d = row_view(residual)
        residual_out = torch.empty_like(x, memory_format=torch.contiguous_format)
        res_out2d = residual_out.view(-1, hidden)
    else:
        res2d = res_out2d = x2d  # unused: HAS_RESIDUAL=False compiles the residual path away
    if num_rows > 0:
        block = triton.next_power_of_2(hidden)
        rows = max(1, _TILE_ELEMENTS // block)  # fixed per width: one compiled variant whatever the batch
        _rms_norm_kernel[(triton.cdiv(num_rows, rows),)](
            x2d, res2d, weight, out2d, res_out2d,
            num_rows, x2d.stride(0), res2d.stride(0), out2d.stride(0), res_out2d.stride(0), eps,
            HIDDEN=hidden, BLOCK=block, ROWS=rows, HAS_RESIDUAL=residual is not None,
        )
    return out if residual is None else (out, residual_out)
