"""The recurrent ops of Gated DeltaNet (kernels/reference_recurrent.py) against independent oracles: transformers'
torch gated delta rule (chunked and recurrent) and a plain conv1d over each whole sequence, on a flattened batch
mixing fresh prefills, continued chunks (state from a slot) and decode rows, across 64-token chunk boundaries and with
grouped value heads. Also the zero-centred RMSNorm the hybrid models use, Triton against the reference."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kernels import reference
from kernels.ops import get_ops
from kernels.reference_recurrent import StateBatch, causal_conv1d, gated_delta_rule

HK, HV, DK, DV, KERNEL = 2, 4, 16, 8, 4


def _batch(lengths: list[int], slots: list[int], initial: list[bool]) -> StateBatch:
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return StateBatch(torch.from_numpy(starts), torch.tensor(slots), torch.tensor(initial), starts,
                      np.array(slots, dtype=np.int32), np.array(initial))


# (tokens, continues a state) per sequence: fresh prefills across chunk boundaries, continued chunks, decodes
SEQUENCES = [(1, False), (63, False), (64, True), (65, False), (130, True), (1, True), (1, True), (7, True)]


def test_gated_delta_rule_matches_transformers() -> None:
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    gen = torch.Generator().manual_seed(0)
    lengths = [n for n, _ in SEQUENCES]
    total = sum(lengths)
    q, k = torch.randn(total, HK, DK, generator=gen), torch.randn(total, HK, DK, generator=gen)
    v = torch.randn(total, HV, DV, generator=gen)
    g = -torch.rand(total, HV, generator=gen) * 0.5
    beta = torch.rand(total, HV, generator=gen)
    slots = list(range(len(SEQUENCES), 0, -1))
    states = torch.randn(len(SEQUENCES) + 1, HV, DK, DV, generator=gen) * 0.1
    before = states.clone()
    out = gated_delta_rule(q, k, v, g, beta, states, _batch(lengths, slots, [i for _, i in SEQUENCES]))
    start = 0
    for (n, initial), slot in zip(SEQUENCES, slots):
        sl = slice(start, start + n)
        want, final = torch_chunk_gated_delta_rule(
            q[None, sl], k[None, sl], v[None, sl], g[None, sl], beta[None, sl],
            initial_state=before[slot][None] if initial else None, output_final_state=True,
            use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(out[sl], want[0], atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(states[slot], final[0], atol=2e-5, rtol=1e-5)
        start += n
    torch.testing.assert_close(states[0], before[0])  # a slot no sequence uses is untouched


def test_decode_rows_follow_the_recurrent_form() -> None:
    """Decode rows (one token, continuing a state) equal transformers' fused-recurrent reference step."""
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule

    gen = torch.Generator().manual_seed(1)
    rows = 5
    q, k = torch.randn(rows, HK, DK, generator=gen), torch.randn(rows, HK, DK, generator=gen)
    v, g, beta = torch.randn(rows, HV, DV, generator=gen), -torch.rand(rows, HV, generator=gen), torch.rand(rows, HV)
    states = torch.randn(rows, HV, DK, DV, generator=gen) * 0.1
    before = states.clone()
    out = gated_delta_rule(q, k, v, g, beta, states, _batch([1] * rows, list(range(rows)), [True] * rows))
    want, final = torch_recurrent_gated_delta_rule(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None],
                                                   initial_state=before, output_final_state=True,
                                                   use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(out, want[:, 0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states, final, atol=1e-5, rtol=1e-5)


def test_causal_conv1d_continues_each_sequences_window() -> None:
    """Each sequence's output equals SiLU(conv1d) over its kept window + new inputs; the window keeps the last
    K - 1 inputs (zeros before a fresh sequence's first token)."""
    gen = torch.Generator().manual_seed(2)
    channels = 12
    lengths = [n for n, _ in SEQUENCES]
    x = torch.randn(sum(lengths), channels, generator=gen)
    weight = torch.randn(channels, KERNEL, generator=gen)
    slots = list(range(len(SEQUENCES)))
    conv_state = torch.randn(len(SEQUENCES), channels, KERNEL - 1, generator=gen)
    before = conv_state.clone()
    out = causal_conv1d(x, weight, conv_state, _batch(lengths, slots, [i for _, i in SEQUENCES]))
    start = 0
    for (n, initial), slot in zip(SEQUENCES, slots):
        history = before[slot] if initial else torch.zeros(channels, KERNEL - 1)
        full = torch.cat([history, x[start:start + n].T], dim=-1)
        want = F.silu(F.conv1d(full[None], weight[:, None], groups=channels))[0].T
        torch.testing.assert_close(out[start:start + n], want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(conv_state[slot], full[:, -(KERNEL - 1):])
        start += n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_centred_rms_norm_triton_matches_reference(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 3, 32, generator=gen).to(dtype)
    weight = (torch.randn(32, generator=gen) * 0.1).to(dtype)
    residual = torch.randn(5, 3, 32, generator=gen).to(dtype)
    want = reference.rms_norm(x, weight, 1e-6, residual, zero_centered=True)
    got = get_ops("triton").rms_norm(x, weight, 1e-6, residual, zero_centered=True)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)
    xf = (x + residual).float()  # HF's Gemma / Qwen3-Next norm: x / rms * (1 + w) in fp32, one rounding
    hf = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + weight.float())).to(dtype)
    torch.testing.assert_close(want[0], hf, atol=0, rtol=0)
