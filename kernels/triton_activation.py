"""Triton SiLU-and-multiply (``kernels.reference.silu_and_mul``)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_utils import row_view

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, INTER: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + INTER + cols, mask=mask, other=0.0).to(tl.float32)
    # silu is rounded to the activation dtype before the product, as the unfused reference does.
    silu = (gate * tl.sigmoid(gate)).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :I]) * x[..., I:]`` for ``x`` ``[..., 2I]``."""
    inter = x.shape[-1] // 2
    x2d = row_view(x)
    out = torch.empty(*x.shape[:-1], inter, dtype=x.dtype, device=x.device)
    out2d = out.view(-1, inter)
    if x2d.shape[0] > 0 and inter > 0:
        block = min(_BLOCK, triton.next_power_of_2(inter))
        _silu_and_mul_kernel[(x2d.shape[0], triton.cdiv(inter, block))](
            x2d, out2d, x2d.stride(0), out2d.stride(0), INTER=inter, BLOCK=block,
        )
    return out
