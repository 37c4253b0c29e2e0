"""MXFP4, as gpt-oss' released checkpoints store their experts: per row, groups of 32 values share one UE8M0 scale
(a power of two, stored as its exponent + 127), and each value is an e2m1 number (one of +-{0, 0.5, 1, 1.5, 2, 3, 4,
6}), two a byte, the first in the low nibble. Written here so that tiny models carry the released layout
(``<weight>_blocks`` ``[..., rows, cols / 32, 16]`` uint8, ``<weight>_scales`` ``[..., rows, cols / 32]`` uint8); the
engine reads it back with `kernels.reference.mxfp4` (dequantized on load, or kept packed for the MXFP4 kernels).
"""
from __future__ import annotations

import torch

from kernels.ops import E2M1_VALUES

GROUP = 32  # values per scale


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(blocks, scales)`` of ``weight`` ``[..., rows, cols]`` (cols a multiple of 32): each group's scale is the least
    power of two that brings its largest magnitude within 6, each value rounded to the nearest e2m1 number."""
    *lead, cols = weight.shape
    if cols % GROUP:
        raise ValueError(f"MXFP4 groups {GROUP} values of a row; {cols} columns are not a multiple of it")
    groups = weight.float().reshape(*lead, cols // GROUP, GROUP)
    amax = groups.abs().amax(-1).clamp(min=2.0**-126)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent)[..., None]
    table = torch.tensor(E2M1_VALUES[:8])
    codes = (scaled.abs()[..., None] - table).abs().argmin(-1) + 8 * (scaled < 0)  # sign in the high bit
    codes = codes.to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exponent + 127).to(torch.uint8)


EXPERT_WEIGHTS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")  # gpt-oss' MXFP4 tensors (not their biases)
QUANTIZATION_CONFIG = {  # gpt-oss-20b's config.json: what stays unquantized
    "quant_method": "mxfp4",
    "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
}


def released_expert_layout(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """gpt-oss tensors as transformers saves them (experts ``[E, in, out]``) with the expert weights as the release
    stores them: ``<name>_blocks`` / ``<name>_scales`` of their ``[E, out, in]`` transpose."""
    out = {}
    for name, tensor in tensors.items():
        if name.endswith(EXPERT_WEIGHTS):
            out[name + "_blocks"], out[name + "_scales"] = quantize_mxfp4(tensor.transpose(1, 2))
        else:
            out[name] = tensor
    return out
