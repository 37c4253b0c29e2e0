"""One MoE layer's experts kept in MXFP4 against the same experts dequantized, side by side in one run: ms per call of
an op set's ``fused_moe_mxfp4`` (packed) and ``fused_moe`` (the experts in the activation dtype), and the experts'
bytes. Default shape: a gpt-oss-20b layer (32 experts, top-4, hidden and intermediate 2880, its biases and clamped
SwiGLU); the weights are random MXFP4, the dequantized copy is exactly their values.

Usage: ``python -m benchmarks.mxfp4_moe [--backend cpu|torch|triton] [--device cpu|cuda] [--tokens 1 32 512]
[--hidden 2880 --intermediate 2880 --experts 32]``; prints one JSON line per token count.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass

import torch

from kernels.ops import dequantize_mxfp4, get_ops


@dataclass(frozen=True)
class Layer:
    experts: int = 32
    hidden: int = 2880
    intermediate: int = 2880
    top_k: int = 4


def packed_layer(layer: Layer, device: str, dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random packed experts (scales 2^-8 .. 2^-5: weights of about 1 / sqrt(K)) and biases."""
    gen = torch.Generator().manual_seed(seed)

    def packed(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        blocks = torch.randint(0, 256, (layer.experts, rows, cols // 2), generator=gen, dtype=torch.uint8)
        scales = torch.randint(119, 123, (layer.experts, rows, cols // 32), generator=gen, dtype=torch.uint8)
        return blocks.to(device), scales.to(device)

    gate_up, down = packed(2 * layer.intermediate, layer.hidden), packed(layer.hidden, layer.intermediate)
    return {"gate_up_blocks": gate_up[0], "gate_up_scales": gate_up[1], "down_blocks": down[0],
            "down_scales": down[1],
            "gate_up_bias": (0.1 * torch.randn(layer.experts, 2 * layer.intermediate, generator=gen)).to(device, dtype),
            "down_bias": (0.1 * torch.randn(layer.experts, layer.hidden, generator=gen)).to(device, dtype)}


def _time_ms(call, device: str, repeat: int) -> float:
    call()  # warm-up (compiles the Triton kernels)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeat):
        call()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeat * 1e3


def compare(layer: Layer, tokens: list[int], backend: str, device: str, dtype: torch.dtype,
            repeat: int) -> list[dict]:
    ops = get_ops(backend)
    weights = packed_layer(layer, device, dtype)
    gate_up = dequantize_mxfp4(weights["gate_up_blocks"], weights["gate_up_scales"]).to(dtype)
    down = dequantize_mxfp4(weights["down_blocks"], weights["down_scales"]).to(dtype)
    packed_bytes = sum(weights[k].numel() for k in ("gate_up_blocks", "gate_up_scales", "down_blocks", "down_scales"))
    dense_bytes = (gate_up.numel() + down.numel()) * gate_up.element_size()
    activation = dict(swiglu_limit=7.0, swiglu_alpha=1.702, gate_up_bias=weights["gate_up_bias"],
                      down_bias=weights["down_bias"])
    gen = torch.Generator().manual_seed(1)
    rows = []
    for count in tokens:
        x = torch.randn(count, layer.hidden, generator=gen).to(device, dtype)
        logits = torch.randn(count, layer.experts, generator=gen)
        best, ids = logits.topk(layer.top_k, dim=-1)
        routing = (best.softmax(-1).to(device), ids.to(device))

        def run_packed() -> torch.Tensor:
            return ops.fused_moe_mxfp4(x, weights["gate_up_blocks"], weights["gate_up_scales"],
                                       weights["down_blocks"], weights["down_scales"], *routing, **activation)

        def run_dense() -> torch.Tensor:
            return ops.fused_moe(x, gate_up, down, *routing, **activation)

        difference = (run_packed().float() - run_dense().float()).abs().max().item()
        packed_ms, dense_ms = _time_ms(run_packed, device, repeat), _time_ms(run_dense, device, repeat)
        rows.append({"backend": backend, "device": device, "dtype": str(dtype).removeprefix("torch."),
                     "tokens": count, **vars(layer), "packed_ms": round(packed_ms, 3),
                     "dequantized_ms": round(dense_ms, 3), "packed_over_dequantized": round(packed_ms / dense_ms, 2),
                     "expert_bytes_packed": packed_bytes, "expert_bytes_dequantized": dense_bytes,
                     "bytes_ratio": round(dense_bytes / packed_bytes, 2), "max_abs_difference": difference})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="cpu", choices=("cpu", "torch", "triton"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 32, 512])
    parser.add_argument("--experts", type=int, default=Layer.experts)
    parser.add_argument("--hidden", type=int, default=Layer.hidden)
    parser.add_argument("--intermediate", type=int, default=Layer.intermediate)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32"))
    layer = Layer(args.experts, args.hidden, args.intermediate)
    for row in compare(layer, args.tokens, args.backend, args.device, dtype, args.repeat):
        print(json.dumps(row))


if __name__ == "__main__":
    main()
