"""The gated SiLU MLP of every supported decoder (dense layers, and DeepSeek's shared experts)."""
from __future__ import annotations

import torch
from torch import nn

from kernels.ops import Ops


class MLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused into one ``gate_up_proj`` (see weights.py)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, ops: Ops, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))
