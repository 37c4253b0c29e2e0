"""Linear layers for CPUs with their weights packed once, at load, into oneDNN's blocked layout.

Why: ``F.linear`` on a CPU calls MKL's sgemm, which re-packs the whole weight matrix into its blocked layout on every
call. At decode batch sizes that packing is a large part of each GEMM (15% of a SmolLM2 decode step's samples), and
for the output head (576 x 49,152, 113 MB) it dominates: on the project's two-core machine oneDNN's linear over a
weight packed once ran the head in 53 ms against MKL's 88 ms at 64 rows, and the decoder's projections 15-25%
faster (one thread, fp32). Outputs differ from MKL's only by the order of the float sums.

The packed copy is held beside the dense weight, which stays the layer's parameter (tied embeddings, MLA's absorbed
``kv_b_proj`` and the memory accounting read it), so packing costs one more copy of the linear weights in host memory.
``KVSERVE_CPU_KERNELS=0`` turns packing off with the native attention kernel (kernels/cpu/attention.py).
"""
from __future__ import annotations

import os

import torch
from torch import nn

PACKED_DTYPES = (torch.float32, torch.bfloat16)


def available() -> bool:
    """Whether oneDNN (MKL-DNN) is built into this torch and not turned off."""
    return os.environ.get("KVSERVE_CPU_KERNELS", "1") != "0" and torch.backends.mkldnn.is_available()


class PackedLinear(nn.Module):
    """``x @ W.T + b`` through oneDNN with ``W`` packed once; ``weight`` and ``bias`` are the original parameters."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        if hasattr(linear, "sharding"):  # tensor parallelism: which part of the checkpoint it holds (memory accounting)
            self.sharding = linear.sharding
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def bf16_supported() -> bool:
    """Whether oneDNN runs bf16 on this CPU (AVX-512 BF16 / AMX, or Arm's bf16). Many laptops and cloud CPUs (AVX2
    only) have neither: there bf16 layers stay unpacked and run through ``F.linear``."""
    return torch.ops.mkldnn._is_mkldnn_bf16_supported()


def packable(linear: nn.Module) -> bool:
    """A plain ``nn.Linear`` (not a subclass: FP8 and other quantized layers compute differently) on the CPU, in a
    dtype oneDNN packs on this CPU."""
    weight = getattr(linear, "weight", None)
    return (type(linear) is nn.Linear and weight.device.type == "cpu" and weight.dtype in PACKED_DTYPES
            and (weight.dtype != torch.bfloat16 or bf16_supported()))


@torch.no_grad()
def pack_linears(model: nn.Module) -> int:
    """Replace every packable linear layer of ``model`` (after its weights are loaded) by a `PackedLinear`; returns
    how many. A no-op where oneDNN is unavailable."""
    if not available():
        return 0
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if packable(child)]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child))
    return len(targets)
