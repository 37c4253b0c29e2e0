"""The one dispatch point: ``get_ops("torch" | "cpu" | "triton")`` returns the op set the model calls.

- ``torch``: the pure-torch reference (kernels/reference/__init__.py), on any device; the oracle every other op set is
  tested against.
- ``cpu``: the reference, with decode attention read in place from the pages by a native kernel
  (kernels/cpu/attention.py; falls back to the reference where it cannot build or run). The default on a CPU.
- ``triton``: the Triton kernels (GPU; on a CPU under ``TRITON_INTERPRET=1`` for tests).

The models reach the kernels through this module alone: the op set, the step's metadata the ops read
(`AttentionMetadata`, `StateBatch`, owned by kernels/attention_metadata.py), and the few pure-torch helpers every
op set shares (below `get_ops`).
"""
from __future__ import annotations

import dataclasses

import torch

from kernels.cpu import attention as cpu_attention
from kernels import reference
from kernels.reference import compressed as reference_compressed
from kernels.reference import image_attention
from kernels.reference import mxfp4 as reference_mxfp4
from kernels.reference import recurrent as reference_recurrent
from kernels.reference import sparse as reference_sparse
from kernels.attention_metadata import AttentionMetadata, StateBatch
from kernels.op_set import Ops
from kernels.triton.utils import interpreting


TORCH_OPS = Ops(
    store_kv=reference.store_kv,
    paged_attention=reference.paged_attention,
    rms_norm=reference.rms_norm,
    rotary_embedding=reference.rotary_embedding,
    silu_and_mul=reference.silu_and_mul,
    gelu_tanh_and_mul=reference.gelu_tanh_and_mul,
    fp8_linear=reference.fp8_block_linear,
    fused_moe=reference.fused_moe,
    fused_moe_mxfp4=reference_mxfp4.fused_moe_mxfp4,
    mla_decode=reference.mla_decode,
    index_topk=reference_sparse.index_topk,
    sparse_mla=reference_sparse.sparse_mla,
    pool_windows=reference_compressed.pool_windows,
    sink_attention=reference_compressed.sink_attention,
    causal_conv1d=reference_recurrent.causal_conv1d,
    gated_delta_rule=reference_recurrent.gated_delta_rule,
)


CPU_OPS = dataclasses.replace(TORCH_OPS, paged_attention=cpu_attention.paged_attention,
                              mla_decode=cpu_attention.mla_decode)
BACKENDS = ("torch", "cpu", "triton")


def get_ops(backend: str) -> Ops:
    if backend == "torch":
        return TORCH_OPS
    if backend == "cpu":
        return CPU_OPS
    if backend == "triton":
        from kernels.triton import ops as triton_ops  # imported lazily: triton is an optional dependency

        return triton_ops.TRITON_OPS
    raise ValueError(f"unknown attention backend {backend!r}; choose one of {', '.join(BACKENDS)}")


def fp8_gemm_supported(backend: str, device: torch.device) -> bool:
    """Whether ``backend`` runs FP8 weights natively on ``device``: the Triton GEMM needs fp8 tensor cores (CUDA
    compute capability 8.9+: Ada, Hopper, Blackwell) or, on a CPU, the Triton interpreter (tests). Elsewhere FP8
    checkpoints are dequantized on load."""
    if backend != "triton":
        return False
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 9)
    return interpreting()


# ---- helpers every op set shares (pure torch; no backend has its own) -------------------------------------------
clamp_swiglu = reference.clamp_swiglu  # DeepSeek-V4's clamped SwiGLU
gather_context = reference.gather_context  # one sequence's first tokens from its blocks (MLA prefill)
ImageSpans = image_attention.ImageSpans
with_image_spans = image_attention.with_image_spans  # Gemma 3's image tokens see their image, under any op set
dequantize_fp8_blocks = reference.dequantize_fp8_blocks  # FP8 block-scaled weights -> dense, at load
dequantize_fp4_blocks = reference.dequantize_fp4_blocks
dequantize_mxfp4 = reference_mxfp4.dequantize_mxfp4  # gpt-oss' packed experts -> dense, at load
E2M1_VALUES = reference.E2M1_VALUES  # the 16 FP4 values by nibble
scales_as_float = reference.scales_as_float
positions_to_slots = reference_sparse.positions_to_slots  # token positions -> KV slots through a block table
query_rows = reference_sparse.query_rows
pooling_state_size = reference_compressed.pooling_state_size

__all__ = ["AttentionMetadata", "BACKENDS", "CPU_OPS", "E2M1_VALUES", "Ops", "StateBatch", "TORCH_OPS", "clamp_swiglu",
           "dequantize_fp4_blocks", "dequantize_fp8_blocks", "dequantize_mxfp4", "fp8_gemm_supported", "gather_context",
           "get_ops", "pooling_state_size", "positions_to_slots", "query_rows", "scales_as_float"]
