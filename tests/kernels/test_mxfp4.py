"""The MXFP4 expert GEMMs: the reference's unpacking against transformers' own MXFP4 conversion, and the Triton
kernel against the reference (under the Triton interpreter on CPU, natively on a GPU; device and tolerances as in
tests/kernels/test_triton_ops.py and tests/kernels/test_moe.py).

Shapes are lean (the interpreter runs each program in Python) but reach what the kernel branches on: ragged expert
groups with an idle expert and a one-token expert, hidden sizes that are not a multiple of the K tile (64 values for
half precision), every byte value (so every e2m1 code in both nibbles, -0 included), scales from 2^-10 to 2^10, and
gpt-oss' biases and clamped SwiGLU beside plain SiLU-and-mul. Unpacking is checked exactly, code by code and scale by
scale; the GEMMs against the reference within the MoE tolerances."""
from __future__ import annotations

import pytest
import torch

from tests.kernels.test_triton_ops import DEVICE, TRITON, assert_close  # sets TRITON_INTERPRET first
from tests.kernels.test_moe import MOE_TOL, routing
from kernels.reference import E2M1_VALUES  # noqa: I001 - after the interpreter switch
from kernels.reference.mxfp4 import dequantize_mxfp4, fused_moe_mxfp4
from kernels.triton.moe import align_by_expert
from kernels.triton.mxfp4 import _launch

GPT_OSS = dict(swiglu_limit=7.0, swiglu_alpha=1.702)  # gpt-oss' clamped SwiGLU
EXPONENTS = (-10, 10)  # scales 2^-10 .. 2^10


def packed(num_experts: int, rows: int, cols: int, gen: torch.Generator,
           exponents: tuple[int, int] = EXPONENTS) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 ``(blocks [E, rows, cols / 2], scales [E, rows, cols / 32])``: every byte value equally likely,
    every scale exponent in ``exponents``."""
    blocks = torch.randint(0, 256, (num_experts, rows, cols // 2), generator=gen, dtype=torch.uint8)
    low, high = exponents
    scales = torch.randint(127 + low, 127 + high + 1, (num_experts, rows, cols // 32), generator=gen,
                           dtype=torch.uint8)
    return blocks.to(DEVICE), scales.to(DEVICE)


def mxfp4_moe_inputs(num_tokens: int, num_experts: int, top_k: int, dtype: torch.dtype, hidden: int, inter: int,
                     seed: int = 0, empty: tuple[int, ...] = (), bias: bool = True) -> tuple[tuple, dict]:
    """Positional arguments and keywords of ``fused_moe_mxfp4``, with scales 2^-8 .. 2^-4 (weights of about
    ``1 / sqrt(K)``, as trained ones): a sum dominated by a few 2^10-scaled terms would test rounding order, not the
    GEMM (the exact test above covers every scale)."""
    gen = torch.Generator().manual_seed(seed)
    gate_up = packed(num_experts, 2 * inter, hidden, gen, (-8, -4))
    down = packed(num_experts, hidden, inter, gen, (-8, -4))
    x = torch.randn(num_tokens, hidden, generator=gen)
    weights, ids = routing(num_tokens, num_experts, top_k, seed, empty)
    keywords = dict(GPT_OSS) if bias else {}
    if bias:
        keywords.update(gate_up_bias=torch.randn(num_experts, 2 * inter, generator=gen).to(DEVICE, dtype),
                        down_bias=torch.randn(num_experts, hidden, generator=gen).to(DEVICE, dtype))
    return (x.to(DEVICE, dtype), *gate_up, *down, weights.to(DEVICE), ids.to(DEVICE)), keywords


def every_byte_under_every_scale() -> tuple[torch.Tensor, torch.Tensor]:
    """``(blocks [1, 21, 256], scales [1, 21, 16])``: each row all 256 bytes (every code in either nibble), row r
    scaled by 2^(r - 10)."""
    exponents = torch.arange(EXPONENTS[0], EXPONENTS[1] + 1)
    blocks = torch.arange(256, dtype=torch.uint8).repeat(len(exponents), 1)[None]
    scales = (127 + exponents).to(torch.uint8).view(1, -1, 1).repeat(1, 1, 16)
    return blocks, scales


def test_reference_unpacks_every_code_under_every_scale() -> None:
    """Against the e2m1 table: the low nibble first, -0 a zero, each group times its power of two."""
    blocks, scales = every_byte_under_every_scale()
    table = torch.tensor(E2M1_VALUES)
    codes = torch.arange(256)
    values = torch.stack([table[codes & 15], table[codes >> 4]], -1).flatten()
    powers = torch.exp2(torch.arange(EXPONENTS[0], EXPONENTS[1] + 1).float())
    ours = dequantize_mxfp4(blocks, scales)
    assert torch.equal(ours[0], values * powers[:, None])
    assert ours[0, 0, 2 * 0x08] == 0 and ours[0, 0, 2 * 0x80 + 1] == 0  # code 8 (-0) in either nibble


@pytest.mark.slow  # imports transformers' integrations (~8 s alone)
def test_reference_unpacks_as_transformers_does() -> None:
    """The same bytes and scales through transformers' ``convert_moe_packed_tensors``, the conversion gpt-oss'
    release is read with by transformers (which stores the blocks as ``[..., cols / 32, 16]``)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = every_byte_under_every_scale()
    theirs = convert_moe_packed_tensors(blocks.view(1, 21, 16, 16), scales, dtype=torch.float32).transpose(1, 2)
    assert torch.equal(dequantize_mxfp4(blocks, scales), theirs)


def test_kernel_unpacks_every_code_under_every_scale_exactly() -> None:
    """The down launch with one-hot activations reads back each weight column: the unpacked tile, exactly (fp32).
    Row r (scaled by 2^(r - 10)) holds 32 bytes: every low code and every high code twice, paired differently in each
    row (K = 64: two tiles of 32)."""
    rows = EXPONENTS[1] - EXPONENTS[0] + 1
    low = torch.arange(32) % 16
    high = [(low + r + 8 * (torch.arange(32) // 16)) % 16 for r in range(rows)]
    blocks = torch.stack([low | (h << 4) for h in high]).to(torch.uint8)[None]
    assert all(len(set(row.tolist())) == 32 for row in blocks[0])
    scales = (127 + torch.arange(EXPONENTS[0], EXPONENTS[1] + 1)).to(torch.uint8).view(1, rows, 1).repeat(1, 1, 2)
    blocks, scales = blocks.to(DEVICE), scales.to(DEVICE)
    num_pairs = 64
    ids = torch.zeros(num_pairs, 1, dtype=torch.int64, device=DEVICE)
    out = torch.zeros(num_pairs, rows, device=DEVICE)
    block_m = 64
    _launch(torch.eye(num_pairs, device=DEVICE), blocks, scales, None, out, torch.ones(num_pairs, device=DEVICE),
            align_by_expert(ids, 1, block_m), 1, block_m)
    assert torch.equal(out.T.cpu(), dequantize_mxfp4(blocks, scales)[0].cpu())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("activation", ["gpt_oss", "silu"])
@pytest.mark.fast_cases("gpt_oss-dtype0")
def test_kernel_matches_reference_on_ragged_groups(dtype: torch.dtype, activation: str) -> None:
    """13 tokens x top-3 over 8 experts, expert 2 idle and expert 7 given exactly one pair; hidden 96 (one and a
    half 64-value half-precision tiles), intermediate 32."""
    args, keywords = mxfp4_moe_inputs(13, 8, 3, dtype, hidden=96, inter=32, seed=1, empty=(2, 7),
                                      bias=activation == "gpt_oss")
    ids = args[-1]
    ids[5, 0] = 7  # one pair for expert 7 (its others were never drawn)
    counts = torch.bincount(ids.flatten().cpu(), minlength=8)
    assert counts[2] == 0 and counts[7] == 1 and counts.max() >= 6
    assert_close(TRITON.fused_moe_mxfp4(*args, **keywords), fp32_reference(args, keywords), MOE_TOL[dtype])


def fp32_reference(args: tuple, keywords: dict) -> torch.Tensor:
    """The reference on the same (half-precision) inputs computed in fp32: the kernel keeps gate and up in fp32 up
    to the activation, where the reference in half precision rounds them first."""
    x, *rest = args
    wide = {k: v.float() if isinstance(v, torch.Tensor) else v for k, v in keywords.items()}
    return fused_moe_mxfp4(x.float(), *rest, **wide).to(x.dtype)


@pytest.mark.parametrize("num_tokens", [1, 70])  # a decode row; tiles of 64 rows
@pytest.mark.fast_cases("1")
def test_kernel_tile_sizes(num_tokens: int) -> None:
    args, keywords = mxfp4_moe_inputs(num_tokens, 4, 4, torch.float32, hidden=64, inter=32, seed=num_tokens)
    assert_close(TRITON.fused_moe_mxfp4(*args, **keywords), fused_moe_mxfp4(*args, **keywords), MOE_TOL[torch.float32])


def test_experts_held_elsewhere_and_empty_batches_add_nothing() -> None:
    """Expert parallelism: ids -1 mark pairs another rank computes (no bias of theirs is added here); a batch of no
    tokens gives no rows."""
    args, keywords = mxfp4_moe_inputs(9, 4, 2, torch.float32, hidden=64, inter=32, seed=3)
    ids = args[-1]
    ids[ids >= 2] = -1
    ids[0] = -1  # a token with every expert elsewhere: a zero row
    out = TRITON.fused_moe_mxfp4(*args, **keywords)
    assert_close(out, fused_moe_mxfp4(*args, **keywords), MOE_TOL[torch.float32])
    assert not out[0].any()
    x, *weights, topk_weights, ids = args
    empty = TRITON.fused_moe_mxfp4(x[:0], *weights, topk_weights[:0], ids[:0], **keywords)
    assert empty.shape == (0, x.shape[1])
