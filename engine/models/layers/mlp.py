"""The gated MLP of every supported decoder (dense layers, and DeepSeek's shared experts): SiLU, or GELU in its
tanh approximation (Gemma)."""
from __future__ import annotations

import torch
from torch import nn

from engine.parallel.linear import Part, column_parallel, row_parallel
from engine.parallel.state import TensorParallel
from kernels.ops import Ops, clamp_swiglu


ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # config.json's names (hidden_act / hidden_activation)


class MLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with gate and up fused into one ``gate_up_proj`` (see weights.py). Under
    tensor parallelism each rank holds a slice of the intermediate dim and returns its partial sum."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp: TensorParallel,
                 swiglu_limit: float | None = None, activation: str = "silu") -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"MLP activation {activation!r} is not supported ({', '.join(ACTIVATIONS)} are)")
        self.gate_up_proj = column_parallel(hidden_size, [Part(intermediate_size)] * 2, tp)
        self.down_proj = row_parallel(intermediate_size, hidden_size, tp)
        self.swiglu_limit = swiglu_limit  # DeepSeek-V4's shared expert clamps its inputs (`clamp_swiglu`)
        self.activation = activation

    def forward(self, ops: Ops, x: torch.Tensor) -> torch.Tensor:
        gate_up = clamp_swiglu(self.gate_up_proj(x), self.swiglu_limit)
        if self.activation == "silu":
            return self.down_proj(ops.silu_and_mul(gate_up))
        return self.down_proj(ops.gelu_tanh_and_mul(gate_up))
