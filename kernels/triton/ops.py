"""The Triton op set returned by ``kernels.ops.get_ops("triton")``; one module per kernel."""
from __future__ import annotations

from kernels.reference import compressed as reference_compressed
from kernels.op_set import Ops
from kernels.triton.activation import gelu_tanh_and_mul, silu_and_mul
from kernels.triton.attention import paged_attention
from kernels.triton.compressed import sink_attention
from kernels.triton.fp8 import fp8_block_linear
from kernels.triton.mla import mla_decode
from kernels.triton.moe import fused_moe
from kernels.triton.mxfp4 import fused_moe_mxfp4
from kernels.triton.recurrent import causal_conv1d, gated_delta_rule
from kernels.triton.rms_norm import rms_norm
from kernels.triton.rotary import rotary_embedding
from kernels.triton.sparse import index_topk, sparse_mla
from kernels.triton.store_kv import store_kv

TRITON_OPS = Ops(
    store_kv=store_kv,
    paged_attention=paged_attention,
    rms_norm=rms_norm,
    rotary_embedding=rotary_embedding,
    silu_and_mul=silu_and_mul,
    gelu_tanh_and_mul=gelu_tanh_and_mul,
    fp8_linear=fp8_block_linear,
    fused_moe=fused_moe,
    fused_moe_mxfp4=fused_moe_mxfp4,
    mla_decode=mla_decode,
    index_topk=index_topk,
    sparse_mla=sparse_mla,
    pool_windows=reference_compressed.pool_windows,  # no Triton kernel yet: the reference runs on the device
    sink_attention=sink_attention,
    causal_conv1d=causal_conv1d,
    gated_delta_rule=gated_delta_rule,
)
