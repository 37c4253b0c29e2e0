"""The gated SiLU MLP of every supported decoder (dense layers, and DeepSeek's shared experts)."""
from __future__ import annotations

import torch
from torch import nn

from engine.parallel.linear import Part, column_parallel, row_parallel
from engine.parallel.state import TensorParallel
from kernels.ops import Ops, clamp_swiglu


class MLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused into one ``gate_up_proj`` (see weights.py). Under
    tensor parallelism each rank holds a slice of the intermediate dim and returns its partial sum."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp: TensorParallel,
                 swiglu_limit: float | None = None) -> None:
        super().__init__()
        self.gate_up_proj = column_parallel(hidden_size, [Part(intermediate_size)] * 2, tp)
        self.down_proj = row_parallel(intermediate_size, hidden_size, tp)
        self.swiglu_limit = swiglu_limit  # DeepSeek-V4's shared expert clamps its inputs (`clamp_swiglu`)

    def forward(self, ops: Ops, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.silu_and_mul(clamp_swiglu(self.gate_up_proj(x), self.swiglu_limit)))
