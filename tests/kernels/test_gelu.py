"""Gemma's gated MLP activation, GELU in its tanh approximation times the up projection: the Triton kernel (under
the interpreter on CPU) against the pure-torch reference, which is torch's own ``gelu(approximate="tanh")``."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.test_triton_ops import DEVICE, ELEMENTWISE_TOL, TRITON, assert_close
from kernels import reference  # noqa: I001 - after the interpreter switch (tests.kernels.test_triton_ops)


def test_reference_is_torch_gelu_tanh() -> None:
    x = torch.randn(5, 2 * 48, generator=torch.Generator().manual_seed(0)) * 4
    assert torch.equal(reference.gelu_tanh_and_mul(x), F.gelu(x[:, :48], approximate="tanh") * x[:, 48:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows,inter", [(7, 128), (3, 1500), (0, 64)])  # 1500: two column blocks, a ragged one
@pytest.mark.fast_cases("7-128-dtype0")
def test_triton_matches_reference(dtype: torch.dtype, rows: int, inter: int) -> None:
    x = (torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(inter)) * 4).to(DEVICE, dtype)
    assert_close(TRITON.gelu_tanh_and_mul(x), reference.gelu_tanh_and_mul(x), ELEMENTWISE_TOL[dtype])
    # the SiLU variant shares the kernel
    assert_close(TRITON.silu_and_mul(x), reference.silu_and_mul(x), ELEMENTWISE_TOL[dtype])
