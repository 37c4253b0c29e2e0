"""gpt-oss' experts kept in MXFP4, as released: the packed bytes and scales stay in memory and the op set's
``fused_moe_mxfp4`` unpacks them tile by tile (``kernels.triton.mxfp4`` on the Triton backend).

Choice (``EngineConfig.mxfp4_experts``): ``auto`` keeps an MXFP4 checkpoint's experts packed where the Triton kernel
runs (the ``triton`` backend: CUDA, or the interpreter in tests), as vLLM keeps them on Hopper, and dequantizes them
on load elsewhere: the CPU op sets' packed path is the reference, which unpacks every routed expert on every call
(docs/MODELS.md has the ratio). ``packed`` keeps them on any backend (a model that would not fit dequantized),
``dequantized`` never does. A checkpoint without MXFP4 experts is unaffected.

Packed, gpt-oss-20b's experts take 4.25 bits a value (a byte per two values, a byte of scale per 32) instead of
bf16's 16: the engine's weights fall from 38.96 to 12.82 GiB (docs/MODELS.md).
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from torch import nn

from engine.models.gpt_oss import MXFP4_BLOCK
from engine.models.layers.moe import Experts, SparseMoE
from kernels.ops import Ops

log = logging.getLogger(__name__)
MXFP4_EXPERTS = ("auto", "packed", "dequantized")


def is_mxfp4_checkpoint(model_dir: Path) -> bool:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return (config.get("quantization_config") or {}).get("quant_method") == "mxfp4"


def keep_experts_packed(choice: str, backend: str, model_dir: Path) -> bool:
    """Whether the experts of the checkpoint in ``model_dir`` stay MXFP4 under ``choice`` on ``backend``."""
    if choice not in MXFP4_EXPERTS:
        raise ValueError(f"mxfp4_experts must be one of {', '.join(MXFP4_EXPERTS)}, got {choice!r}")
    if choice == "dequantized" or not is_mxfp4_checkpoint(model_dir):
        return False
    return choice == "packed" or backend == "triton"


class Mxfp4Experts(nn.Module):
    """`Experts` with the weights as ``gate_up_proj_blocks`` ``[E, 2I, H / 2]`` / ``gate_up_proj_scales``
    ``[E, 2I, H / 32]`` and ``down_proj_blocks`` ``[E, H, I / 2]`` / ``down_proj_scales`` ``[E, H, I / 32]``
    (uint8; ``kernels.reference.mxfp4`` has the format); the biases as `Experts` holds them."""

    def __init__(self, experts: Experts) -> None:
        super().__init__()
        num_experts, rows, hidden = experts.gate_up_proj.shape
        inter = rows // 2
        if inter % MXFP4_BLOCK or hidden % MXFP4_BLOCK:
            raise ValueError(f"MXFP4 experts kept packed need whole groups of {MXFP4_BLOCK} values per rank; this "
                             f"rank holds {inter} intermediate columns (choose another tensor_parallel_size, "
                             "--enable-expert-parallel, or --mxfp4-experts dequantized)")
        self.sharding = experts.sharding
        device = experts.gate_up_proj.device

        def packed(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=torch.uint8, device=device), requires_grad=False)

        self.gate_up_proj_blocks = packed(num_experts, rows, hidden // 2)
        self.gate_up_proj_scales = packed(num_experts, rows, hidden // MXFP4_BLOCK)
        self.down_proj_blocks = packed(num_experts, hidden, inter // 2)
        self.down_proj_scales = packed(num_experts, hidden, inter // MXFP4_BLOCK)
        self.gate_up_proj_bias = experts.gate_up_proj_bias
        self.down_proj_bias = experts.down_proj_bias

    def forward(self, ops: Ops, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, **extra) -> torch.Tensor:
        return ops.fused_moe_mxfp4(x, self.gate_up_proj_blocks, self.gate_up_proj_scales, self.down_proj_blocks,
                                   self.down_proj_scales, weights, ids, **extra)


def use_mxfp4_experts(model: nn.Module) -> int:
    """Swap every MoE layer's `Experts` for `Mxfp4Experts` (on the meta device, before memory is allocated: the
    experts are never held at full precision); returns how many."""
    swapped = 0
    for module in model.modules():
        if isinstance(module, SparseMoE) and isinstance(module.experts, Experts):
            module.experts = Mxfp4Experts(module.experts)
            swapped += 1
    log.info("MXFP4 checkpoint: the experts of %d MoE layers stay packed", swapped)
    return swapped
