"""The fused MoE op: its reference against a per-token oracle, and the Triton kernel against the reference (under the
Triton interpreter on CPU, natively on a GPU; device and tolerances as in tests/kernels/test_triton_ops.py)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.test_triton_ops import DEVICE, TRITON, assert_close  # sets TRITON_INTERPRET first
from kernels import reference  # noqa: I001 - after the interpreter switch
from kernels.triton.moe import align_by_expert, choose_block_m

# Expert GEMMs add up 48-64 products per output, so half precision gets the attention tolerances' headroom.
MOE_TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def routing(num_tokens: int, num_experts: int, top_k: int, seed: int, empty: tuple[int, ...] = ()) -> tuple:
    """Distinct experts per token drawn from a skewed distribution (ragged loads); experts in ``empty`` get none."""
    gen = torch.Generator().manual_seed(seed)
    popularity = torch.linspace(4.0, 0.2, num_experts) ** 2
    popularity[list(empty)] = 0.0
    ids = torch.stack([torch.multinomial(popularity, top_k, generator=gen) for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, top_k, generator=gen)
    return weights / weights.sum(-1, keepdim=True), ids


def moe_inputs(num_tokens: int, num_experts: int, top_k: int, dtype: torch.dtype, hidden: int = 48,
               inter: int = 40, seed: int = 0, empty: tuple[int, ...] = ()) -> tuple:
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(num_tokens, hidden, generator=gen)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    down = torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5
    weights, ids = routing(num_tokens, num_experts, top_k, seed, empty)
    return (x.to(DEVICE, dtype), gate_up.to(DEVICE, dtype), down.to(DEVICE, dtype), weights.to(DEVICE),
            ids.to(DEVICE))


def per_token_oracle(x, gate_up, down, weights, ids) -> torch.Tensor:
    """Each token's experts one at a time, in fp64: an independent check of the reference."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            h = gate_up[e].double() @ x[t].double()
            g, u = h.chunk(2)
            out[t] += weights[t, k].double() * (down[e].double() @ (F.silu(g) * u))
    return out


def test_reference_matches_per_token_oracle() -> None:
    inputs = moe_inputs(13, 8, 3, torch.float32, empty=(2,))
    expected = per_token_oracle(*(t.cpu() for t in inputs))
    torch.testing.assert_close(reference.fused_moe(*inputs).cpu().double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.fast_cases("1-dtype0")
def test_fused_moe_matches_reference_with_ragged_loads_and_idle_experts(dtype: torch.dtype, top_k: int) -> None:
    inputs = moe_inputs(37, 16, top_k, dtype, seed=top_k, empty=(0, 9))
    ids = inputs[-1].cpu()
    counts = torch.bincount(ids.flatten(), minlength=16)
    assert counts[0] == counts[9] == 0 and counts.max() > 3 * counts[counts > 0].min()  # ragged, with idle experts
    assert_close(TRITON.fused_moe(*inputs), reference.fused_moe(*inputs), MOE_TOL[dtype])


@pytest.mark.parametrize("num_tokens, top_k", [(1, 2), (70, 8)])  # a decode row; tiles of 64 rows
@pytest.mark.fast_cases("1-2")
def test_fused_moe_tile_sizes(num_tokens: int, top_k: int) -> None:
    inputs = moe_inputs(num_tokens, 8, top_k, torch.float32, hidden=80, inter=72, seed=num_tokens)
    assert_close(TRITON.fused_moe(*inputs), reference.fused_moe(*inputs), MOE_TOL[torch.float32])


def test_fused_moe_strided_hidden_and_empty_batch() -> None:
    x, gate_up, down, weights, ids = moe_inputs(9, 8, 2, torch.float32)
    wide = torch.randn(9, 2 * x.shape[1], device=DEVICE)
    wide[:, : x.shape[1]] = x
    strided = wide[:, : x.shape[1]]
    assert not strided.is_contiguous()
    assert_close(TRITON.fused_moe(strided, gate_up, down, weights, ids), reference.fused_moe(x, gate_up, down,
                 weights, ids), 1e-5)
    empty = TRITON.fused_moe(x[:0], gate_up, down, weights[:0], ids[:0])
    assert empty.shape == (0, x.shape[1])


@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.fast_cases("16")
def test_align_by_expert_tiles_hold_one_expert_each(block_m: int) -> None:
    _, ids = routing(23, 8, 4, seed=3, empty=(5,))
    sorted_pairs, tile_experts, num_padded = align_by_expert(ids, 8, block_m)
    num_pairs = ids.numel()
    used = int(num_padded)
    assert used % block_m == 0 and sorted_pairs.numel() >= used
    real = sorted_pairs[:used]
    assert sorted(real[real < num_pairs].tolist()) == list(range(num_pairs))  # every pair exactly once
    assert (sorted_pairs[used:] == num_pairs).all()
    flat = ids.flatten()
    for tile in range(used // block_m):
        rows = real[tile * block_m : (tile + 1) * block_m]
        rows = rows[rows < num_pairs].long()
        assert len(rows) > 0 and (flat[rows] == tile_experts[tile]).all()  # no tile is all padding
    assert choose_block_m(8, 8) == 16 and choose_block_m(8 * 40, 8) == 64


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.fast_cases("dtype0")
def test_experts_held_elsewhere_add_nothing(dtype: torch.dtype) -> None:
    """Expert parallelism: this rank holds experts 4..7 of 8; ids -1 mark the pairs of the other rank's experts."""
    x, gate_up, down, weights, ids = moe_inputs(29, 8, 3, dtype, seed=5)
    local = ids - 4
    local = local.masked_fill((local < 0) | (local >= 4), -1)
    assert (local == -1).any() and (local >= 0).any()
    held = torch.where(local >= 0, weights, torch.zeros_like(weights))  # the same sum, other experts weighted 0
    expected = per_token_oracle(*(t.cpu() for t in (x, gate_up[4:], down[4:], held, local.clamp(min=0))))
    assert_close(reference.fused_moe(x, gate_up[4:], down[4:], weights, local).cpu().double(), expected,
                 MOE_TOL[dtype])
    assert_close(TRITON.fused_moe(x, gate_up[4:], down[4:], weights, local),
                 reference.fused_moe(x, gate_up[4:], down[4:], weights, local), MOE_TOL[dtype])
