"""Triton gated activations: SiLU-and-multiply and GELU(tanh)-and-multiply (``kernels.reference.silu_and_mul``,
``kernels.reference.gelu_tanh_and_mul``)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.utils import row_view

_BLOCK = 1024


@triton.jit
def _gated_act_kernel(x_ptr, out_ptr, stride_x, stride_o, INTER: tl.constexpr, BLOCK: tl.constexpr,
                      GELU: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + INTER + cols, mask=mask, other=0.0).to(tl.float32)
    if GELU:  # 0.5 x (1 + tanh(y)) = x sigmoid(2y), y = sqrt(2 / pi) (x + 0.044715 x^3)
        # 2 sqrt(2 / pi) as a literal: the GPU compiler refuses a plain float global ("Cannot access global
        # variable"), which the interpreter takes
        act = gate * tl.sigmoid(1.5957691216057308 * (gate + 0.044715 * gate * gate * gate))
    else:
        act = gate * tl.sigmoid(gate)
    # the activation is rounded to the activation dtype before the product, as the unfused reference does.
    act = act.to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def _gated_act(x: torch.Tensor, gelu: bool) -> torch.Tensor:
    inter = x.shape[-1] // 2
    x2d = row_view(x)
    out = torch.empty(*x.shape[:-1], inter, dtype=x.dtype, device=x.device)
    out2d = out.view(-1, inter)
    if x2d.shape[0] > 0 and inter > 0:
        block = min(_BLOCK, triton.next_power_of_2(inter))
        _gated_act_kernel[(x2d.shape[0], triton.cdiv(inter, block))](
            x2d, out2d, x2d.stride(0), out2d.stride(0), INTER=inter, BLOCK=block, GELU=gelu,
        )
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :I]) * x[..., I:]`` for ``x`` ``[..., 2I]``."""
    return _gated_act(x, gelu=False)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(x[..., :I]) * x[..., I:]`` for ``x`` ``[..., 2I]``."""
    return _gated_act(x, gelu=True)
