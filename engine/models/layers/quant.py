"""FP8 block-scaled checkpoints (DeepSeek-V3, Qwen3 ``-FP8``): the format, and the linear layer that keeps them FP8.

The format: config.json carries ``quantization_config`` ``{"quant_method": "fp8", "fmt": "e4m3",
"weight_block_size": [block_n, block_k], "activation_scheme": "dynamic"}``; each quantized linear stores ``weight``
as float8_e4m3fn ``[out, in]`` next to a float32 ``weight_scale_inv`` ``[ceil(out / block_n), ceil(in / block_k)]``,
and its value is ``fp8 * scale_inv`` block by block. Embeddings, norms, the output head and router gates stay
unquantized: a tensor is quantized exactly when the checkpoint has a ``weight_scale_inv`` next to it. DeepSeek-V4 adds
``"expert_dtype": "fp4"`` (MoE experts packed two e2m1 values a byte, int8 ``[out, in / 2]``, one scale per row and
32 columns) and ``"scale_fmt": "ue8m0"`` (scales stored as powers of two); FP4 weights are always dequantized.

Where the Triton FP8 GEMM runs (``kernels.ops.fp8_gemm_supported``) quantized linears become :class:`Fp8Linear` and
keep their FP8 bytes; elsewhere the loader dequantizes them to the engine dtype (see ``engine.weights``).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from kernels.ops import dequantize_fp8_blocks, scales_as_float

SCALE_SUFFIX = ".weight_scale_inv"


@dataclass(frozen=True)
class Fp8Format:
    """How a checkpoint's FP8 weights are blocked (``weight_block_size``)."""

    block_n: int
    block_k: int

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Fp8Format | None:
        """The format named by a config.json's ``quantization_config``; None for an unquantized checkpoint."""
        quant = config.get("quantization_config")
        if not quant:
            return None
        method = quant.get("quant_method")
        if method == "mxfp4":  # gpt-oss' experts (engine/models/layers/mxfp4_experts.py), no FP8 layers
            return None
        if method != "fp8":
            raise ValueError(f"quant_method {method!r} is not supported: kvserve loads unquantized checkpoints, "
                             "block-scaled FP8 ones (quant_method 'fp8', as DeepSeek-V3 and the Qwen3 -FP8 releases) "
                             "and gpt-oss' MXFP4 experts")
        if quant.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"FP8 format {quant['fmt']!r} is not supported; only e4m3 weights are")
        if quant.get("expert_dtype", "fp8") not in ("fp8", "fp4"):
            raise ValueError(f"expert_dtype {quant['expert_dtype']!r} is not supported; FP8 and FP4 experts are")
        if quant.get("activation_scheme", "dynamic") != "dynamic":
            raise ValueError("static FP8 activation scales are not supported; kvserve quantizes activations "
                             "dynamically (activation_scheme 'dynamic')")
        block = quant.get("weight_block_size")
        if not block or len(block) != 2:
            raise ValueError("FP8 checkpoints need quantization_config.weight_block_size (e.g. [128, 128]); "
                             "per-tensor FP8 scales are not supported")
        return cls(int(block[0]), int(block[1]))

    @classmethod
    def from_model_dir(cls, model_dir: Path) -> Fp8Format | None:
        return cls.from_config(json.loads((Path(model_dir) / "config.json").read_text()))

    @property
    def block(self) -> tuple[int, int]:
        return self.block_n, self.block_k

    def scale_shape(self, rows: int, cols: int) -> tuple[int, int]:
        return -(-rows // self.block_n), -(-cols // self.block_k)

    def covering_scales(self, rows: slice, cols: slice) -> tuple[tuple[slice, slice], tuple[int, int]]:
        """For the part ``[rows, cols]`` of a weight (explicit bounds): the slice of its scale grid whose blocks cover
        it, and where the part starts within its first block (``(0, 0)`` when it starts on a block boundary)."""
        grid = (slice(rows.start // self.block_n, -(-rows.stop // self.block_n)),
                slice(cols.start // self.block_k, -(-cols.stop // self.block_k)))
        return grid, (rows.start % self.block_n, cols.start % self.block_k)

    def dequantize(self, scale_name: str, weight: torch.Tensor, scale_inv: torch.Tensor,
                   dtype: torch.dtype, offset: tuple[int, int] = (0, 0)) -> torch.Tensor:
        """``weight`` (or a part of it starting ``offset`` into the first block of ``scale_inv``) in ``dtype``."""
        want = self.scale_shape(weight.shape[0] + offset[0], weight.shape[1] + offset[1])
        if tuple(scale_inv.shape) != want:
            raise ValueError(f"{scale_name}: shape {tuple(scale_inv.shape)} does not block a {tuple(weight.shape)} "
                             f"weight by {list(self.block)} (expected {want})")
        return dequantize_fp8_blocks(weight, scales_as_float(scale_inv), self.block, offset).to(dtype)


class Fp8Linear(nn.Module):
    """``x @ W.T + b`` with W kept in e4m3 and one float32 scale per ``scale_rows x block_k`` block, computed by
    the op set's ``fp8_linear`` (the Triton block-scaled GEMM on a GPU).

    A fused projection (q/k/v, gate/up) stacks its shards' checkpoint scales. When every shard but the last spans
    whole blocks of ``block_n`` rows, the stacked grid keeps that block height; otherwise a block would straddle two
    shards, so each output row gets its own scale row (``scale_rows`` 1: the same values, spread).
    """

    def __init__(self, linear: nn.Linear, fmt: Fp8Format, shard_sizes: list[int], gemm: Callable) -> None:
        super().__init__()
        num_out, width = linear.weight.shape
        device = linear.weight.device
        self.block_n = fmt.block_n
        self.block_k = fmt.block_k
        self.scale_rows = fmt.block_n if all(size % fmt.block_n == 0 for size in shard_sizes[:-1]) else 1
        self.weight = nn.Parameter(torch.empty(num_out, width, dtype=torch.float8_e4m3fn, device=device),
                                   requires_grad=False)
        grid = (-(-num_out // self.scale_rows), -(-width // fmt.block_k))
        self.weight_scale_inv = nn.Parameter(torch.empty(grid, dtype=torch.float32, device=device), requires_grad=False)
        self.bias = linear.bias
        self.sharding = getattr(linear, "sharding", None)  # this rank's part of a tensor-parallel layer
        self.gemm = gemm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemm(x, self.weight, self.weight_scale_inv, (self.scale_rows, self.block_k), self.bias)

    def load_scales(self, scale_name: str, scale_inv: torch.Tensor, rows: slice | None) -> None:
        """Copy a checkpoint's scale grid for output ``rows`` of this layer (one shard of a fused projection)."""
        rows = rows or slice(0, self.weight.shape[0])
        size = rows.stop - rows.start
        want = (-(-size // self.block_n), self.weight_scale_inv.shape[1])
        if tuple(scale_inv.shape) != want:
            raise ValueError(f"{scale_name}: shape {tuple(scale_inv.shape)} does not block a ({size}, "
                             f"{self.weight.shape[1]}) weight by {[self.block_n, self.block_k]} (expected {want})")
        spread = scales_as_float(scale_inv).repeat_interleave(self.block_n // self.scale_rows, dim=0)[: -(-size // self.scale_rows)]
        start = rows.start // self.scale_rows
        self.weight_scale_inv[start : start + spread.shape[0]].copy_(spread)

    def extra_repr(self) -> str:
        num_out, width = self.weight.shape
        return f"in_features={width}, out_features={num_out}, bias={self.bias is not None}, " \
               f"scale_block=({self.scale_rows}, {self.block_k})"


def swap_in_fp8_linears(model: nn.Module, layers: dict[str, list[int]], fmt: Fp8Format, gemm: Callable) -> int:
    """Replace the ``nn.Linear`` at each path of ``layers`` (path -> its shards' output sizes) with an
    :class:`Fp8Linear`; returns how many were replaced. Quantized tensors of other modules get dequantized."""
    swapped = 0
    for path, shard_sizes in layers.items():
        parent_path, _, child = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        linear = getattr(parent, child)
        if isinstance(linear, nn.Linear):
            setattr(parent, child, Fp8Linear(linear, fmt, shard_sizes, gemm))
            swapped += 1
    return swapped
