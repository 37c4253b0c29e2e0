"""The one Triton helper every FP8 kernel stores through: fp32 -> e4m3 with saturation, rounded to nearest even.

On a GPU the conversion is the hardware's (``cvt.rn.satfinite``) after an explicit clamp. The Triton 3.x interpreter
rounds fp32 -> fp8 wrongly (7.9 becomes 4.0, 500 becomes 256) but converts values already on the e4m3 grid
exactly, so under the interpreter the value is first rounded onto the grid in fp32 arithmetic; both paths give
``torch.Tensor.to(torch.float8_e4m3fn)`` of the clamped value.
"""
from __future__ import annotations

import triton
import triton.language as tl

from kernels.triton.utils import interpreting


def software_fp8_rounding() -> bool:
    """The ``SOFTWARE_ROUNDING`` flag to pass to kernels calling :func:`to_e4m3`."""
    return interpreting()


@triton.jit
def to_e4m3(x, SOFTWARE_ROUNDING: tl.constexpr):
    """``x`` (fp32) saturated to [-448, 448] (e4m3fn has no infinity) and rounded to nearest even, as
    ``tl.float8e4nv``."""
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    if SOFTWARE_ROUNDING:
        bits = x.to(tl.int32, bitcast=True)
        magnitude = bits & 0x7FFFFFFF
        sign = bits ^ magnitude
        # Normal range: keep 3 of fp32's 23 mantissa bits, ties to even (a carry may bump the exponent, as it must).
        normal = (magnitude + 0x7FFFF + ((magnitude >> 20) & 1)) & -0x100000
        # Subnormal range (below 2^-6) is a fixed grid of 2^-9: adding 1.5 * 2^14, whose fp32 ulp is 2^-9, rounds
        # to it with the FPU's own ties-to-even; subtracting it back is exact.
        subnormal = ((magnitude.to(tl.float32, bitcast=True) + 24576.0) - 24576.0).to(tl.int32, bitcast=True)
        rounded = tl.where(magnitude < 0x3C800000, subnormal, normal)  # 0x3C800000 is 2^-6
        x = (rounded | sign).to(tl.float32, bitcast=True)
    return x.to(tl.float8e4nv)
