"""Pure-torch reference of the MXFP4 expert GEMMs (``kernels.triton.mxfp4``): mixture-of-experts whose expert weights
stay packed, as gpt-oss' released checkpoints store them.

An expert weight ``[E, N, K]`` (``N`` output rows, ``K`` a multiple of 32) is held as ``blocks`` uint8
``[E, N, K / 2]`` (two e2m1 codes a byte, the value at the even column in the low nibble; code bit 3 is the sign, so
code 8 is -0) and ``scales`` uint8 ``[E, N, K / 32]`` (UE8M0 exponents: each group of 32 values of a row is multiplied
by ``2^(s - 127)``). The reference unpacks each routed expert to the activation dtype and runs `routed_experts`: the
same arithmetic as the engine's dequantized-on-load experts, so either layout gives the same tokens.
"""
from __future__ import annotations

import torch

from kernels.reference import dequantize_fp4_blocks, routed_experts

GROUP = 32  # values per UE8M0 scale


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 ``[..., N, K]`` of packed ``blocks`` ``[..., N, K / 2]`` with ``scales`` ``[..., N, K / 32]``."""
    *lead, rows, width = blocks.shape
    values = dequantize_fp4_blocks(blocks.reshape(-1, width), scales.reshape(-1, scales.shape[-1]))
    return values.view(*lead, rows, 2 * width)


def fused_moe_mxfp4(
    hidden: torch.Tensor,
    gate_up_blocks: torch.Tensor,
    gate_up_scales: torch.Tensor,
    down_blocks: torch.Tensor,
    down_scales: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    swiglu_limit: float | None = None,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    swiglu_alpha: float | None = None,
) -> torch.Tensor:
    """``kernels.reference.fused_moe`` over packed experts: ``gate_up`` ``[E, 2I, H]`` (gate rows, then up) as
    ``gate_up_blocks`` ``[E, 2I, H / 2]`` / ``gate_up_scales`` ``[E, 2I, H / 32]``, ``down`` ``[E, H, I]`` as
    ``down_blocks`` ``[E, H, I / 2]`` / ``down_scales`` ``[E, H, I / 32]``; the other arguments as there."""

    def unpacked(expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (dequantize_mxfp4(gate_up_blocks[expert], gate_up_scales[expert]).to(hidden.dtype),
                dequantize_mxfp4(down_blocks[expert], down_scales[expert]).to(hidden.dtype))

    return routed_experts(hidden, unpacked, gate_up_blocks.shape[0], topk_weights, topk_ids, swiglu_limit,
                          gate_up_bias, down_bias, swiglu_alpha)
