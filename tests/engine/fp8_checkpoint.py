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

from kernels.reference import quantize_fp8_blocks

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
