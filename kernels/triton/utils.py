"""Small host-side helpers shared by the Triton kernel modules."""
from __future__ import annotations

import functools
import os

import torch


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def upcast_bf16_dot(dtype: torch.dtype) -> bool:
    """Whether ``tl.dot`` operands of ``dtype`` must be widened to fp32 before the dot.

    The Triton 3.x interpreter stores bf16 as raw uint16 and its ``dot`` multiplies those integers, so under the
    interpreter bf16 operands are widened first. bf16 products are exact in fp32, so the result equals a bf16 dot
    with an fp32 accumulator, which is what the compiled kernel computes on a GPU.
    """
    return interpreting() and dtype == torch.bfloat16


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_compute_units(device: torch.device) -> int:
    """Streaming multiprocessors on a CUDA device; 1 elsewhere (the interpreter runs programs one by one)."""
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _sm_count(index)


def row_view(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[rows, last_dim]`` with a unit stride on the last dim (a copy only when needed)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x.reshape(-1, x.shape[-1])
