"""Write an FP8 block-scaled copy of a model directory, in the layout of DeepSeek-V3 and the Qwen3 -FP8 releases.

Every decoder projection (q/k/v/o, gate/up/down) becomes float8_e4m3fn with a float32 ``weight_scale_inv`` per
block; embeddings, norms, biases and the output head stay as they were. The weights and their scales go to two
different shards (with an index), so a loader has to find a weight's scale across files.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kernels.reference import (E2M1_VALUES, dequantize_fp4_blocks, dequantize_fp8_blocks,
                               quantize_fp8_blocks)

_QUANTIZED = re.compile(r"layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight$")


def write_fp8_checkpoint(src: Path, dst: Path, block: tuple[int, int]) -> None:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    weights: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(str(src / "model.safetensors")).items():
        if _QUANTIZED.search(name):
            weights[name], scales[name.removesuffix("weight") + "weight_scale_inv"] = quantize_fp8_blocks(tensor, block)
        else:
            weights[name] = tensor
    shards = {"model-00001-of-00002.safetensors": weights, "model-00002-of-00002.safetensors": scales}
    for file, tensors in shards.items():
        save_file(tensors, str(dst / file), metadata={"format": "pt"})
    weight_map = {name: file for file, tensors in shards.items() for name in tensors}
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block),
    }
    (dst / "config.json").write_text(json.dumps(config, indent=2))


_V4_EXPERT = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")
_V4_LINEAR = re.compile(r"\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b)\.weight$|\.ffn\.shared_experts\.w[123]\.weight$")


def quantize_fp4_rows(weight: torch.Tensor, group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V4's FP4 experts: int8 ``[out, in / 2]`` (two e2m1 values a byte, low nibble first) and UE8M0 scales
    ``[out, in / group]``, each the power of two that brings its group's largest magnitude within e2m1's 6."""
    rows, cols = weight.shape
    groups = weight.float().view(rows, cols // group, group)
    scale = torch.exp2(torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=1e-30) / 6.0)))
    table = torch.tensor(E2M1_VALUES)
    nearest = ((groups / scale[..., None]).reshape(rows, cols)[..., None] - table).abs().argmin(-1)
    packed = (nearest[:, 0::2] | (nearest[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    return packed, scale.to(torch.float8_e8m0fnu)


def write_v4_fp8_fp4_checkpoint(src: Path, dst: Path, plain: Path, block: tuple[int, int]) -> None:
    """A DeepSeek-V4 checkpoint as DeepSeek ships them: routed experts FP4, attention projections and shared
    experts FP8 block-scaled; and ``plain``, the same values dequantized to fp32 without a quantization_config."""
    for out in (dst, plain):
        shutil.copytree(src, out, ignore=shutil.ignore_patterns("*.safetensors"))
    quantized: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(str(src / "model.safetensors")).items():
        scale_name = name.removesuffix("weight") + "weight_scale_inv"
        if _V4_EXPERT.search(name):
            quantized[name], quantized[scale_name] = quantize_fp4_rows(tensor)
            dequantized[name] = dequantize_fp4_blocks(quantized[name], quantized[scale_name])
        elif _V4_LINEAR.search(name):
            quantized[name], quantized[scale_name] = quantize_fp8_blocks(tensor, block)
            dequantized[name] = dequantize_fp8_blocks(quantized[name], quantized[scale_name], block)
        else:
            quantized[name] = dequantized[name] = tensor
    save_file(quantized, str(dst / "model.safetensors"), metadata={"format": "pt"})
    save_file(dequantized, str(plain / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block),
        "expert_dtype": "fp4", "scale_fmt": "ue8m0",
    }
    (dst / "config.json").write_text(json.dumps(config, indent=2))
