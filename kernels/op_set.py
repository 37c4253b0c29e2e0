"""The op set a model calls, one field per op: every implementation (kernels/ops.py's torch and cpu sets,
kernels/triton/ops.py's Triton set) is one `Ops`. A leaf module, so that the Triton set builds one without importing
the dispatch point that loads it."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Ops:
    store_kv: Callable
    paged_attention: Callable
    rms_norm: Callable
    rotary_embedding: Callable
    silu_and_mul: Callable
    gelu_tanh_and_mul: Callable  # Gemma's gated MLP
    fp8_linear: Callable  # x @ W.T + b for a block-scaled e4m3 weight
    fused_moe: Callable
    fused_moe_mxfp4: Callable  # the same over experts kept in MXFP4 (gpt-oss' released experts)
    mla_decode: Callable
    index_topk: Callable  # DeepSeek-V3.2's lightning indexer: the slots each query attends to
    sparse_mla: Callable  # absorbed MLA over those slots
    pool_windows: Callable  # DeepSeek-V4's compressors: gated pooling of token windows, state in the pages
    sink_attention: Callable  # DeepSeek-V4's attention over gathered slots, with per-head sinks
    causal_conv1d: Callable  # recurrent layers (Gated DeltaNet): conv over each sequence's state row
    gated_delta_rule: Callable
