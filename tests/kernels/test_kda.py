"""Kimi Delta Attention's gated delta rule (a decay per key channel, ``g`` ``[T, H, Dk]``) in
kernels/reference/recurrent.py against transformers' torch KDA (chunked and recurrent), on a flattened batch mixing
fresh prefills, continued chunks and decode rows across 64-token chunks; then the Triton kernel against that
reference (under the interpreter on CPU, natively with ``KVSERVE_KERNEL_TEST_DEVICE``)."""
from __future__ import annotations

import pytest
import torch

from kernels.ops import get_ops
from kernels.reference.recurrent import gated_delta_rule
from tests.kernels.test_recurrent import DEVICE, _batch

H, DK, DV = 3, 16, 8
# (tokens, continues a state): fresh prefills across chunk boundaries, continued chunks, decodes
SEQUENCES = [(1, False), (63, False), (64, True), (65, False), (130, True), (1, True), (1, True), (7, True)]


def _inputs(sequences: list[tuple[int, bool]], seed: int, dtype: torch.dtype = torch.float32):
    """q, k, v, a channel-wise log decay as Kimi's forget gate makes it (down to about -16 per token: a 64-token
    chunk decays some channels by far more than fp32 holds, which a factored exp(g_i) * exp(-g_j) would overflow),
    beta, and random states for 10 slots."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(n for n, _ in sequences)
    q, k = (torch.randn(total, H, DK, generator=gen).to(dtype) for _ in range(2))
    v = torch.randn(total, H, DV, generator=gen).to(dtype)
    g = -torch.rand(total, H, DK, generator=gen) ** 4 * 16
    beta = torch.rand(total, H, generator=gen).to(dtype)
    return (q, k, v, g, beta), torch.randn(10, H, DK, DV, generator=gen) * 0.1


@pytest.mark.parametrize("sequences", [SEQUENCES[5:], SEQUENCES], ids=["short", "across_chunks"])
@pytest.mark.fast_cases("short")
def test_kda_matches_transformers_chunked_and_recurrent(sequences: list[tuple[int, bool]]) -> None:
    from transformers.models.kimi_linear.modeling_kimi_linear import (
        chunk_kimi_delta_attention, recurrent_kimi_delta_attention,
    )

    (q, k, v, g, beta), states = _inputs(sequences, 0)
    before = states.clone()
    slots = list(range(len(sequences), 0, -1))
    out = gated_delta_rule(q, k, v, g, beta, states, _batch([n for n, _ in sequences], slots,
                                                             [i for _, i in sequences]))
    start = 0
    for (n, initial), slot in zip(sequences, slots):
        sl = slice(start, start + n)
        hf = recurrent_kimi_delta_attention if n == 1 and initial else chunk_kimi_delta_attention
        want, final = hf(q[None, sl], k[None, sl], v[None, sl], g[None, sl], beta[None, sl],
                         initial_state=before[slot][None] if initial else None, output_final_state=True,
                         use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(out[sl], want[0], atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(states[slot], final[0], atol=2e-5, rtol=1e-5)
        start += n
    torch.testing.assert_close(states[0], before[0])  # a slot no sequence uses is untouched
    assert out.abs().max() > 0.1 and torch.isfinite(states).all()


def test_a_decay_per_channel_is_not_one_per_head() -> None:
    """The same decay in every channel gives Gated DeltaNet's rule; different ones give other outputs."""
    sequences = [(70, False), (1, True)]
    (q, k, v, g, beta), states = _inputs(sequences, 1)
    batch = _batch([70, 1], [0, 1], [False, True])
    per_head = gated_delta_rule(q, k, v, g[..., 0], beta, states.clone(), batch)
    torch.testing.assert_close(gated_delta_rule(q, k, v, g[..., :1].expand_as(g), beta, states.clone(), batch),
                               per_head, atol=1e-5, rtol=1e-5)
    assert (gated_delta_rule(q, k, v, g, beta, states.clone(), batch) - per_head).abs().max() > 0.1


TRITON_SEQUENCES = [(1, False), (17, True), (65, True), (1, True), (1, True), (16, True), (5, False)]
TRITON_SLOTS = [3, 9, 1, 5, 0, 8, -1]  # the last row is padding: untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.slow
def test_triton_kda_matches_reference(dtype: torch.dtype) -> None:
    (q, k, v, g, beta), states = _inputs(TRITON_SEQUENCES, 2, dtype)
    lengths, initial = [n for n, _ in TRITON_SEQUENCES], [i for _, i in TRITON_SEQUENCES]
    want_states = states.clone()
    want = gated_delta_rule(q, k, v, g, beta, want_states, _batch(lengths, TRITON_SLOTS, initial))
    got_states = states.to(DEVICE)
    got = get_ops("triton").gated_delta_rule(*(x.to(DEVICE) for x in (q, k, v, g, beta)), got_states,
                                              _batch(lengths, TRITON_SLOTS, initial, DEVICE))
    real = slice(0, sum(lengths[:-1]))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.cpu()[real], want[real], atol=tol, rtol=tol)
    torch.testing.assert_close(got_states.cpu(), want_states, atol=1e-5 if dtype == torch.float32 else 1e-2, rtol=1e-5)
