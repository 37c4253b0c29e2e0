"""FP8 kernels against their references: the block-scaled GEMM, and KV pages stored as e4m3 (store + attention).

On CPU the Triton kernels run under the interpreter (see tests/kernels/test_triton_ops.py for the device choice). Tolerances:
the GEMM quantizes activations exactly as the reference does (bit for bit), so only fp32 summation order differs:
fp32 outputs within 1e-5 of the output's largest magnitude; bf16 within 1e-2 and fp16 within 2e-3 of it, about two
ulps of the output dtype (the interpreter truncates fp32 -> bf16 where the reference rounds). On a GPU, tiles of 64
rows run Hopper's fp8 wgmma, whose accumulation keeps about 14 bits (DeepSeek-V3 report, 3.3.2) until the kernel
promotes each group's sum: fp32 outputs there within 5e-4 (an emulation of 13-bit truncating accumulation puts these
cases at 0.9e-4 to 1.0e-4; a fp16 output's own rounding is 4.9e-4).
"""
from __future__ import annotations

import pytest
import torch

from tests.kernels.test_triton_ops import DEVICE, MIXED_CONTEXT, MIXED_QUERY, assert_close, make_batch  # sets the interpreter
from kernels import reference  # noqa: I001 - after the interpreter switch
from kernels.ops import get_ops

TRITON = get_ops("triton")
FP8 = torch.float8_e4m3fn
OUTPUT_TOL = {torch.float32: 5e-4 if DEVICE == "cuda" else 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def e4m3_grid() -> torch.Tensor:
    """Every finite e4m3 value, the midpoints between neighbours (ties), and values beyond the range."""
    grid = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    grid = grid[~grid.isnan()].unique()
    ties = (grid[1:] + grid[:-1]) / 2
    return torch.cat([grid, ties, torch.tensor([449.0, 464.0, 500.0, -1e4, 1e-9, -1e-9, 3e-3, -0.0])])


# ------------------------------------------------------------------------------------------------ block quantization


def test_quantize_fp8_blocks_format_and_error_bound() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(70, 45, generator=gen) * torch.logspace(-3, 2, 45)  # columns of very different magnitudes
    values, scale_inv = reference.quantize_fp8_blocks(x, (32, 16))
    assert values.dtype == FP8 and values.shape == (70, 45)
    assert scale_inv.dtype == torch.float32 and scale_inv.shape == (3, 3)  # partial edge blocks included
    # each block's largest magnitude lands exactly on 448
    tiles = values.float().abs()
    assert tiles[:32, :16].max() == 448 and tiles[64:, 32:].max() == 448
    # e4m3 keeps 3 mantissa bits: at most half an ulp (2^-4 relative) off, plus the subnormal step of the block
    restored = reference.dequantize_fp8_blocks(values, scale_inv, (32, 16))
    step = scale_inv.repeat_interleave(32, 0)[:70].repeat_interleave(16, 1)[:, :45] * 2.0**-10
    assert ((restored - x).abs() <= x.abs() * 2.0**-4 + step).all()


def test_dequantize_is_value_times_block_scale() -> None:
    values = torch.tensor([[1.0, -2.0, 0.5], [448.0, 0.0, -0.125]]).to(FP8)
    scale_inv = torch.tensor([[2.0, 0.25]])  # blocks of 2 x 2: columns {0, 1} and {2}
    expected = torch.tensor([[2.0, -4.0, 0.125], [896.0, 0.0, -0.03125]])
    assert torch.equal(reference.dequantize_fp8_blocks(values, scale_inv, (2, 2)), expected)


# ------------------------------------------------------------------------------------------------------ FP8 GEMM


@pytest.mark.parametrize(
    "rows, num_out, width, block",
    [
        (1, 64, 64, (32, 32)),  # one decode row
        (5, 40, 72, (16, 32)),  # N and K not multiples of the block: partial edge blocks both ways
        (33, 130, 96, (32, 32)),  # ragged rows across two 32-row tiles, partial last column tile
        (17, 96, 100, (1, 48)),  # one scale row per output row (fused shards off the block grid), K group of 48
        (70, 256, 256, (128, 128)),  # the real checkpoints' blocks: 64-row and 128-column tiles
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.fast_cases("dtype0-1-64-64-block0")
def test_fp8_gemm_matches_reference(rows: int, num_out: int, width: int, block: tuple[int, int],
                                    dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(rows + num_out)
    weight, scale_inv = reference.quantize_fp8_blocks(torch.randn(num_out, width, generator=gen), block)
    x = (torch.randn(rows, width, generator=gen) * torch.logspace(-2, 1, width)).to(dtype)
    bias = torch.randn(num_out, generator=gen).to(dtype)
    args = (x.to(DEVICE), weight.to(DEVICE), scale_inv.to(DEVICE), block)
    for b in (None, bias.to(DEVICE)):
        expected = reference.fp8_block_linear(*args, b)
        got = TRITON.fp8_linear(*args, b)
        assert got.dtype == dtype and got.shape == (rows, num_out)
        scale = expected.float().abs().max().item()
        torch.testing.assert_close(got.float(), expected.float(), atol=OUTPUT_TOL[dtype] * scale, rtol=0)


def test_fp8_gemm_is_close_to_the_unquantized_product() -> None:
    """The reference itself: quantizing W (per block) and x (per token group) costs a few percent, not more."""
    gen = torch.Generator().manual_seed(1)
    w, x = torch.randn(96, 128, generator=gen), torch.randn(9, 128, generator=gen)
    weight, scale_inv = reference.quantize_fp8_blocks(w, (32, 32))
    out = reference.fp8_block_linear(x, weight, scale_inv, (32, 32))
    exact = x @ w.T
    assert (out - exact).norm() / exact.norm() < 0.05


def test_fp8_gemm_strided_batched_input_and_empty_batch() -> None:
    """x as a slice of a wider tensor with leading batch dims (as a fused projection hands it over), and no rows."""
    gen = torch.Generator().manual_seed(2)
    weight, scale_inv = reference.quantize_fp8_blocks(torch.randn(48, 64, generator=gen), (16, 16))
    wide = torch.randn(2, 3, 100, generator=gen)
    x = wide[..., 10:74]
    assert not x.is_contiguous()
    args = (weight.to(DEVICE), scale_inv.to(DEVICE), (16, 16))
    got = TRITON.fp8_linear(x.to(DEVICE), *args)
    assert got.shape == (2, 3, 48)
    assert_close(got, reference.fp8_block_linear(x.to(DEVICE), *args), 1e-5)
    assert TRITON.fp8_linear(torch.empty(0, 64, device=DEVICE), *args).shape == (0, 48)


def test_fp8_gemm_zero_rows_and_saturating_activations() -> None:
    """An all-zero token group (no 0/0 in its scale) and activations spanning 1e-6..1e4 in one group."""
    gen = torch.Generator().manual_seed(3)
    weight, scale_inv = reference.quantize_fp8_blocks(torch.randn(32, 32, generator=gen), (32, 32))
    x = torch.randn(4, 32, generator=gen)
    x[1] = 0
    x[2] = torch.logspace(-6, 4, 32)
    args = (x.to(DEVICE), weight.to(DEVICE), scale_inv.to(DEVICE), (32, 32))
    got = TRITON.fp8_linear(*args)
    assert torch.isfinite(got).all() and (got[1] == 0).all()
    assert_close(got, reference.fp8_block_linear(*args), 1e-5)


# ---------------------------------------------------------------------------------------------------- FP8 KV pages


def test_store_kv_fp8_pages_round_like_torch() -> None:
    """Every e4m3 value, every tie between neighbours (to even), saturation beyond 448, tiny values and -0."""
    values = e4m3_grid()
    heads, dim = 2, 64
    num_tokens = -(-values.numel() // (heads * dim))
    key = torch.zeros(num_tokens * heads * dim)
    key[: values.numel()] = values
    key = key.view(num_tokens, heads, dim)
    value = -key.flip(0)
    slots = torch.randperm(num_tokens + 8)[:num_tokens]
    for dtype in (torch.float32, torch.bfloat16):
        caches = [torch.zeros(num_tokens + 8, 1, heads, dim, dtype=FP8, device=DEVICE) for _ in range(4)]
        k_in, v_in, slot_in = key.to(DEVICE, dtype), value.to(DEVICE, dtype), slots.to(DEVICE)
        reference.store_kv(k_in, v_in, caches[0], caches[1], slot_in)
        TRITON.store_kv(k_in, v_in, caches[2], caches[3], slot_in)
        assert torch.equal(caches[2].view(torch.uint8), caches[0].view(torch.uint8))
        assert torch.equal(caches[3].view(torch.uint8), caches[1].view(torch.uint8))
        stored = caches[0].view(-1, heads, dim)[slots.to(DEVICE)].float().cpu()
        assert torch.equal(stored, k_in.float().cpu().clamp(-448, 448).to(FP8).float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split_k", [False, True])
@pytest.mark.fast_cases("False-dtype0")
def test_paged_attention_reads_fp8_pages(dtype: torch.dtype, split_k: bool) -> None:
    context, query = (MIXED_CONTEXT, MIXED_QUERY) if not split_k else ([1, 5, 37, 70], [1, 1, 1, 1])
    batch = make_batch(context, query, 2, 2, 64, 4, dtype, seed=5)
    batch.k_cache, batch.v_cache = batch.k_cache.to(FP8), batch.v_cache.to(FP8)
    expected = reference.paged_attention(*batch.args())
    got = TRITON.paged_attention(*batch.args(), split_k=split_k, **({"partition_size": 16} if split_k else {}))
    assert_close(got, expected, {torch.float32: 1e-5, torch.bfloat16: 3e-2}[dtype])


def test_fp4_blocks_dequantize_nibbles_with_ue8m0_scales() -> None:
    """DeepSeek-V4's FP4 experts: two e2m1 values a byte (low nibble first), one power-of-two scale per row and 32
    columns; values on the e2m1 grid come back exactly, others within half a grid step."""
    from kernels.reference import E2M1_VALUES, dequantize_fp4_blocks
    from tests.models.checkpoints.fp8_checkpoint import quantize_fp4_rows

    grid = torch.tensor(E2M1_VALUES)
    exact = grid[torch.randint(0, 16, (4, 64), generator=torch.Generator().manual_seed(0))] * 0.25
    exact[:, ::32] = 1.5  # every group's largest magnitude within 6 x its power-of-two scale
    packed, scales = quantize_fp4_rows(exact)
    assert packed.dtype == torch.int8 and packed.shape == (4, 32) and scales.dtype == torch.float8_e8m0fnu
    assert torch.equal(dequantize_fp4_blocks(packed, scales), exact)
    assert torch.equal(dequantize_fp4_blocks(packed, scales.view(torch.uint8)), exact)  # raw exponent bytes
    weight = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    packed, scales = quantize_fp4_rows(weight)
    step = scales.float().repeat_interleave(32, dim=1)  # e2m1's widest gap is 2 (between 4 and 6)
    assert ((dequantize_fp4_blocks(packed, scales) - weight).abs() <= step).all()
