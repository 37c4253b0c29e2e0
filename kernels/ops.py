"""The one dispatch point: ``get_ops("torch")`` or ``get_ops("triton")`` returns the op set the model calls."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kernels import reference


@dataclass(frozen=True)
class Ops:
    store_kv: Callable
    paged_attention: Callable
    rms_norm: Callable
    rotary_embedding: Callable
    silu_and_mul: Callable
    fused_moe: Callable
    mla_decode: Callable


TORCH_OPS = Ops(
    store_kv=reference.store_kv,
    paged_attention=reference.paged_attention,
    rms_norm=reference.rms_norm,
    rotary_embedding=reference.rotary_embedding,
    silu_and_mul=reference.silu_and_mul,
    fused_moe=reference.fused_moe,
    mla_decode=reference.mla_decode,
)


def get_ops(backend: str) -> Ops:
    if backend == "torch":
        return TORCH_OPS
    if backend == "triton":
        from kernels import triton_ops  # imported lazily: triton is an optional dependency

        return triton_ops.TRITON_OPS
    raise ValueError(f"unknown attention backend {backend!r}; choose 'torch' or 'triton'")
