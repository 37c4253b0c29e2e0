"""Compile every Triton kernel ahead of time for a CUDA target, on a machine without a GPU.

The interpreter checks what the kernels compute, not whether they compile: ``tl.dot`` shape rules, shared-memory
limits and lowering errors only show up in the real compiler. This module runs each op's host wrapper on small CPU
tensors with kernel launches intercepted; every launch is compiled (Triton's compiler + the bundled ptxas) to a
cubin for the target instead of running. The launches are the wrapper's own, so the block sizes and constexprs
checked are exactly the ones the GPU will see for those shapes.

Usage (not under ``TRITON_INTERPRET=1``): ``python -m kernels.triton.aot [--arch 90]``
"""
from __future__ import annotations

import argparse
import contextlib
import inspect
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from kernels.attention_metadata import StateBatch

_TRITON_DTYPES = {
    torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
    torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8", torch.float8_e4m3fn: "fp8e4nv", torch.bool: "i1",
}
LAUNCH_OPTIONS = ("num_warps", "num_stages")  # keywords of a launch that are compiler options, not kernel arguments
# Opt-in shared memory per block on sm_80+ (A100: 163 KiB, H100/H200: 227 KiB); the smaller bound is the check.
SHARED_MEMORY_LIMIT = 163 * 1024


@dataclass(frozen=True)
class CompiledKernel:
    name: str
    constexprs: dict
    shared_bytes: int
    seconds: float
    stack_bytes: int | None  # local memory a thread: register spills (None: no cuobjdump to read the cubin with)


def _arg_type(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + _TRITON_DTYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"unsupported kernel argument {value!r}")


def compile_launch(kernel: JITFunction, args: tuple, kwargs: dict, target: GPUTarget) -> CompiledKernel:
    """Compile one intercepted launch ``kernel[grid](*args, **kwargs)`` for ``target``."""
    options = {name: kwargs[name] for name in LAUNCH_OPTIONS if name in kwargs}
    arguments = {name: value for name, value in kwargs.items() if name not in LAUNCH_OPTIONS}
    bound = inspect.signature(kernel.fn).bind(*args, **arguments).arguments
    signature, constexprs = {}, {}
    for index, param in enumerate(kernel.params):
        value = bound[param.name]
        if param.is_constexpr:
            signature[param.name] = "constexpr"
            constexprs[(index,)] = value
        else:
            signature[param.name] = _arg_type(value)
    start = time.perf_counter()
    compiled = triton.compile(ASTSource(kernel, signature, constexprs=constexprs), target=target, options=options)
    shared = compiled.metadata.shared
    if shared > SHARED_MEMORY_LIMIT:
        raise RuntimeError(f"{kernel.__name__} needs {shared} bytes of shared memory (limit {SHARED_MEMORY_LIMIT})")
    named = {kernel.params[i[0]].name: v for i, v in constexprs.items()}
    return CompiledKernel(kernel.__name__, {**named, **options}, shared, time.perf_counter() - start,
                          _stack_bytes(compiled.asm["cubin"]))


def _stack_bytes(cubin: bytes) -> int | None:
    """The kernel's stack frame a thread (where ptxas spills registers), read by the cuobjdump Triton bundles."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.is_file():
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        usage = subprocess.run([str(tool), "-res-usage", file.name], capture_output=True, text=True).stdout
    found = re.search(r"STACK:(\d+)", usage)
    return int(found.group(1)) if found else None


@contextlib.contextmanager
def compile_instead_of_launch(target: GPUTarget) -> Iterator[list[CompiledKernel]]:
    """Within the block, ``kernel[grid](...)`` compiles for ``target`` and records the result instead of running."""
    compiled: list[CompiledKernel] = []
    original = JITFunction.run

    def run(self: JITFunction, *args, grid, warmup, **kwargs):  # noqa: ANN001 - Triton's own signature
        compiled.append(compile_launch(self, args, kwargs, target))

    JITFunction.run = run
    try:
        yield compiled
    finally:
        JITFunction.run = original


def _attention_inputs(
    query_lens: list[int], context_lens: list[int], dtype: torch.dtype,
    num_heads: int = 16, num_kv_heads: int = 8, head_dim: int = 128, block_size: int = 16,
) -> tuple:
    """Qwen3-0.6B-shaped attention inputs (values are never read: launches only compile)."""
    pages = sum(-(-c // block_size) for c in context_lens)
    k_cache = torch.empty(pages, block_size, num_kv_heads, head_dim, dtype=dtype)
    starts = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    block_tables = torch.zeros(len(context_lens), pages, dtype=torch.int32)
    query = torch.empty(int(starts[-1]), num_heads, head_dim, dtype=dtype)
    return (query, k_cache, torch.empty_like(k_cache), block_tables,
            torch.tensor(context_lens, dtype=torch.int32), starts, head_dim ** -0.5)


def compile_all(arch: int) -> list[CompiledKernel]:
    """Compile the launches of every op at Qwen3-0.6B shapes (prefill, decode, split-K decode) for ``sm_<arch>``."""
    from kernels.triton import ops

    with compile_instead_of_launch(GPUTarget("cuda", arch, 32)) as compiled:
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            ops.paged_attention(*_attention_inputs([100, 1], [300, 2000], dtype))  # prefill tiles
            ops.paged_attention(*_attention_inputs([1, 1], [300, 2000], dtype), split_k=False)  # decode
        ops.paged_attention(*_attention_inputs([1, 1], [300, 2000], torch.bfloat16), split_k=True)
        ops.paged_attention(*_attention_inputs([1], [5000], torch.bfloat16, num_heads=32, num_kv_heads=4,
                                               head_dim=64), split_k=True)
        x = torch.empty(4, 1024, dtype=torch.bfloat16)
        ops.rms_norm(x, torch.empty(1024, dtype=torch.bfloat16), 1e-6)
        ops.rms_norm(x, torch.empty(1024, dtype=torch.bfloat16), 1e-6, torch.empty_like(x))
        ops.silu_and_mul(torch.empty(4, 2 * 3072, dtype=torch.bfloat16))
        q, k = torch.empty(4, 16, 128, dtype=torch.bfloat16), torch.empty(4, 8, 128, dtype=torch.bfloat16)
        ops.rms_norm(q, torch.empty(128, dtype=torch.bfloat16), 1e-6)  # Qwen3's per-head q/k norm
        ops.rotary_embedding(torch.zeros(4, dtype=torch.int64), q, k, torch.empty(4096, 128))
        ops.store_kv(k, k, torch.empty(8, 16, 8, 128, dtype=torch.bfloat16), torch.empty(8, 16, 8, 128,
                     dtype=torch.bfloat16), torch.zeros(4, dtype=torch.int64))
        _compile_fp8(ops)
        _compile_moe_and_mla(ops)
        _compile_mxfp4_moe(ops)
        _compile_recurrent(ops)
    return compiled


def _compile_fp8(ops) -> None:  # noqa: ANN001 - the Triton op set
    """FP8 KV pages (store and attention) and the block-scaled FP8 GEMM at Qwen3-8B-FP8 shapes (128 x 128 blocks)."""
    fp8 = torch.float8_e4m3fn
    pages = torch.empty(8, 16, 8, 128, dtype=fp8)
    k = torch.empty(4, 8, 128, dtype=torch.bfloat16)
    ops.store_kv(k, k, pages, torch.empty_like(pages), torch.zeros(4, dtype=torch.int64))
    query, _, _, *rest = _attention_inputs([100, 1], [300, 2000], torch.bfloat16)
    ops.paged_attention(query, pages, torch.empty_like(pages), *rest)
    query, _, _, *rest = _attention_inputs([1, 1], [300, 2000], torch.bfloat16)
    ops.paged_attention(query, pages, torch.empty_like(pages), *rest, split_k=True)
    weight = torch.empty(6144, 4096, dtype=fp8)  # a fused qkv projection
    for rows in (1, 24, 512):  # decode, a small batch, a prefill chunk
        ops.fp8_block_linear(torch.empty(rows, 4096, dtype=torch.bfloat16), weight, torch.empty(48, 32), (128, 128))
    ops.fp8_block_linear(torch.empty(512, 4096, dtype=torch.bfloat16), weight, torch.empty(6144, 32), (1, 128),
                   torch.empty(6144, dtype=torch.bfloat16))


def _compile_moe_and_mla(ops) -> None:  # noqa: ANN001 - the triton_ops module
    """Qwen3-30B-A3B's experts (128 of 768, top-8, hidden 2048) and DeepSeek-V3's MLA (512 + 64 latent row)."""
    for dtype, tokens in ((torch.bfloat16, 4), (torch.bfloat16, 512), (torch.float32, 4)):
        ids = torch.zeros(tokens, 8, dtype=torch.int64)  # values unused, but the alignment runs on the CPU
        ops.fused_moe(torch.empty(tokens, 2048, dtype=dtype), torch.empty(128, 2 * 768, 2048, dtype=dtype),
                      torch.empty(128, 2048, 768, dtype=dtype), torch.rand(tokens, 8), ids)
    cache = torch.empty(64, 16, 1, 576, dtype=torch.bfloat16)
    tables, lens = torch.zeros(2, 64, dtype=torch.int32), torch.full((2,), 1000, dtype=torch.int32)
    for heads in (16, 128):
        query = torch.empty(2, heads, 576, dtype=torch.bfloat16)
        for split in (False, True):
            ops.mla_decode(query, cache, tables, lens, 0.1, 512, max_context_len=1000, split_k=split)
    latent = torch.empty(4, 1, 576, dtype=torch.bfloat16)
    ops.store_kv(latent[..., :512], latent[..., 512:], cache[..., :512], cache[..., 512:],
                 torch.zeros(4, dtype=torch.int64))


def _compile_mxfp4_moe(ops) -> None:  # noqa: ANN001 - the triton_ops module
    """gpt-oss-20b's experts kept in MXFP4 (32, top-4, hidden and intermediate 2880: 90 groups of 32, not a multiple
    of the 64-value K tile), with its biases and clamped SwiGLU."""
    experts, width, u8 = 32, 2880, torch.uint8
    packed = (torch.empty(experts, 2 * width, width // 2, dtype=u8),
              torch.empty(experts, 2 * width, width // 32, dtype=u8),
              torch.empty(experts, width, width // 2, dtype=u8), torch.empty(experts, width, width // 32, dtype=u8))
    for dtype, tokens in ((torch.bfloat16, 4), (torch.bfloat16, 512), (torch.float32, 4)):
        ids = torch.zeros(tokens, 4, dtype=torch.int64)
        ops.fused_moe_mxfp4(torch.empty(tokens, width, dtype=dtype), *packed, torch.rand(tokens, 4), ids,
                            swiglu_limit=7.0, gate_up_bias=torch.empty(experts, 2 * width, dtype=dtype),
                            down_bias=torch.empty(experts, width, dtype=dtype), swiglu_alpha=1.702)


def _compile_recurrent(ops) -> None:  # noqa: ANN001 - the triton_ops module
    """Gated DeltaNet at Qwen3.6-35B-A3B's shapes (16 key / 32 value heads of 128; conv over q, k and v) in bf16 and
    fp32: two prefill rows (the chunked kernels) and the recurrent one. (Kimi Delta Attention's per-channel decay
    is left out: its two chunked kernels take 90 s to compile.)"""
    tokens, dim = 1024, 128
    starts = np.array([0, 600, tokens], dtype=np.int32)
    batch = StateBatch(torch.from_numpy(starts), torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.bool),
                       starts, np.zeros(2, dtype=np.int32), np.zeros(2, dtype=bool))
    key_heads, value_heads = 16, 32
    for dtype in (torch.bfloat16, torch.float32):
        q, k = (torch.empty(tokens, key_heads, dim, dtype=dtype) for _ in range(2))
        v = torch.empty(tokens, value_heads, dim, dtype=dtype)
        ops.gated_delta_rule(q, k, v, torch.empty(tokens, value_heads), torch.empty(tokens, value_heads, dtype=dtype),
                             torch.empty(4, value_heads, dim, dim), batch)
    channels = 2 * key_heads * dim + value_heads * dim
    ops.causal_conv1d(torch.empty(tokens, channels, dtype=torch.bfloat16),
                      torch.empty(channels, 4, dtype=torch.bfloat16),
                      torch.empty(4, channels, 3, dtype=torch.bfloat16), batch)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability as an int (90 = H100/H200)")
    args = parser.parse_args(argv)
    for kernel in compile_all(args.arch):
        consts = ", ".join(f"{k}={v}" for k, v in kernel.constexprs.items())
        print(f"ok  {kernel.name:<28} shared={kernel.shared_bytes:>6}B  stack={kernel.stack_bytes}B  "
              f"{kernel.seconds:5.2f}s  {consts}")


if __name__ == "__main__":
    main()
