"""The recurrent ops of Gated DeltaNet (kernels/reference/recurrent.py) against independent oracles: transformers'
torch gated delta rule (chunked and recurrent) and a plain conv1d over each whole sequence, on a flattened batch
mixing fresh prefills, continued chunks (state from a slot) and decode rows, across 64-token chunk boundaries and with
grouped value heads. Then the Triton kernels (kernels/triton/recurrent.py) against that reference, on CPU under the
interpreter or natively on a GPU (``KVSERVE_KERNEL_TEST_DEVICE``, as tests/kernels/test_triton_ops.py; gpu_check runs this file),
and the zero-centred RMSNorm the hybrid models use."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kernels import reference
from kernels.ops import get_ops
from kernels.reference.recurrent import StateBatch, causal_conv1d, gated_delta_rule

HK, HV, DK, DV, KERNEL = 2, 4, 16, 8, 4
DEVICE = os.environ.get("KVSERVE_KERNEL_TEST_DEVICE", "cuda" if torch.cuda.is_available() else "cpu")


def _batch(lengths: list[int], slots: list[int], initial: list[bool], device: str = "cpu") -> StateBatch:
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return StateBatch(torch.from_numpy(starts).to(device), torch.tensor(slots, device=device),
                      torch.tensor(initial, device=device), starts, np.array(slots, dtype=np.int32), np.array(initial))


def _per_value_head(x: torch.Tensor) -> torch.Tensor:
    """Query / key heads ``[..., HK, DK]`` repeated for the value heads they serve (consecutive groups, as the
    reference reads them). transformers' torch gated delta rules take them so up to 5.17 at least (the H200 image's:
    its layer repeats them before the call); later versions repeat them themselves when the counts differ."""
    return x.repeat_interleave(HV // HK, dim=-2)


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
            _per_value_head(q[None, sl]), _per_value_head(k[None, sl]), v[None, sl], g[None, sl], beta[None, sl],
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
    want, final = torch_recurrent_gated_delta_rule(_per_value_head(q[:, None]), _per_value_head(k[:, None]),
                                                   v[:, None], g[:, None], beta[:, None],
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


# Triton vs the reference: fresh and continued prefills across 64-token chunks and 16-token blocks, one-token rows
# (fresh and continuing), a padding row (slot -1: untouched), ragged lengths
TRITON_SEQUENCES = [(1, False), (17, True), (64, False), (65, True), (130, False), (1, True), (1, True), (16, True),
                    (5, False)]
TRITON_SLOTS = [3, 9, 1, 7, 2, 5, 0, 8, -1]


def _triton_inputs(value_heads: int, dtype: torch.dtype, decode_only: bool = False):
    sequences = [(1, True)] * 5 + [(1, False)] if decode_only else TRITON_SEQUENCES
    slots = list(range(len(sequences))) if decode_only else TRITON_SLOTS
    gen = torch.Generator().manual_seed(4)
    total = sum(n for n, _ in sequences)
    q, k = (torch.randn(total, HK, DK, generator=gen).to(dtype) for _ in range(2))
    v = torch.randn(total, value_heads, DV, generator=gen).to(dtype)
    g = -torch.rand(total, value_heads, generator=gen) * 0.5
    beta = torch.rand(total, value_heads, generator=gen).to(dtype)
    states = torch.randn(10, value_heads, DK, DV, generator=gen) * 0.1
    padded = [sum(n for n, _ in sequences[:i]) + j for i, (n, _) in enumerate(sequences) for j in range(n)
              if slots[i] < 0]
    return sequences, slots, (q, k, v, g, beta), states, padded


@pytest.mark.parametrize("value_heads,dtype,decode_only", [(4, torch.float32, False), (6, torch.float32, False),
                                                          (4, torch.bfloat16, False), (6, torch.float32, True)])
@pytest.mark.slow
def test_triton_gated_delta_rule_matches_reference(value_heads: int, dtype: torch.dtype, decode_only: bool) -> None:
    """Value heads per key head 2 and 3; decode-only: the recurrent kernel alone (what a decode graph runs)."""
    sequences, slots, inputs, states, padded = _triton_inputs(value_heads, dtype, decode_only)
    lengths, initial = [n for n, _ in sequences], [i for _, i in sequences]
    want_states = states.clone()
    want = gated_delta_rule(*inputs, want_states, _batch(lengths, slots, initial))
    got_states = states.to(DEVICE)
    got = get_ops("triton").gated_delta_rule(*(x.to(DEVICE) for x in inputs), got_states,
                                              _batch(lengths, slots, initial, DEVICE))
    real = torch.ones(len(want), dtype=torch.bool)
    real[padded] = False
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.cpu()[real], want[real], atol=tol, rtol=tol)
    torch.testing.assert_close(got_states.cpu(), want_states, atol=1e-5 if dtype == torch.float32 else 1e-2,
                               rtol=1e-5)  # slots of no sequence (and the padding row's) untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.slow
def test_triton_causal_conv1d_matches_reference(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    channels = 130  # more than one tile of channels
    lengths, initial = [n for n, _ in TRITON_SEQUENCES], [i for _, i in TRITON_SEQUENCES]
    x = torch.randn(sum(lengths), channels, generator=gen).to(dtype)
    weight = torch.randn(channels, KERNEL, generator=gen).to(dtype)
    conv_state = torch.randn(10, channels, KERNEL - 1, generator=gen).to(dtype)
    want_state = conv_state.clone()
    want = causal_conv1d(x, weight, want_state, _batch(lengths, TRITON_SLOTS, initial))
    got_state = conv_state.to(DEVICE)
    got = get_ops("triton").causal_conv1d(x.to(DEVICE), weight.to(DEVICE), got_state,
                                           _batch(lengths, TRITON_SLOTS, initial, DEVICE))
    real = slice(0, sum(lengths[:-1]))  # the last row is padding (slot -1)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.cpu()[real], want[real], atol=tol, rtol=tol)
    torch.testing.assert_close(got_state.cpu(), want_state, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.fast_cases("dtype0")
def test_zero_centred_rms_norm_triton_matches_reference(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 3, 32, generator=gen).to(dtype)
    weight = (torch.randn(32, generator=gen) * 0.1).to(dtype)
    residual = torch.randn(5, 3, 32, generator=gen).to(dtype)
    want = reference.rms_norm(x, weight, 1e-6, residual, zero_centered=True)
    got = get_ops("triton").rms_norm(x.to(DEVICE), weight.to(DEVICE), 1e-6, residual.to(DEVICE), zero_centered=True)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for a, b in zip(got, want):
        torch.testing.assert_close(a.cpu(), b, atol=tol, rtol=tol)
    xf = (x + residual).float()  # HF's Gemma / Qwen3-Next norm: x / rms * (1 + w) in fp32, one rounding
    hf = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + weight.float())).to(dtype)
    torch.testing.assert_close(want[0], hf, atol=0, rtol=0)


# Speculative decoding: verification rows (a token and its drafts) keep the state after each of their first tokens in
# slots of their own, beside decode and prefill rows. (tokens, continues a state, slots kept per token or None)
VERIFY_SEQUENCES = [(5, True, [6, 7, 8, 9, -1]), (1, True, None), (9, False, None), (3, True, [10, 11, -1]),
                    (2, True, [12, -1])]
VERIFY_SLOTS = [0, 1, 2, 3, 4]


def _verify_batch(device: str = "cpu") -> StateBatch:
    batch = _batch([n for n, _, _ in VERIFY_SEQUENCES], VERIFY_SLOTS, [i for _, i, _ in VERIFY_SEQUENCES], device)
    keep = np.concatenate([np.array(k if k else [-1] * n) for n, _, k in VERIFY_SEQUENCES]).astype(np.int64)
    batch.host_token_state_rows, batch.token_state_rows = keep, torch.from_numpy(keep).to(device)
    return batch


def _verify_inputs(dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(6)
    total = sum(n for n, _, _ in VERIFY_SEQUENCES)
    q, k = (torch.randn(total, HK, DK, generator=gen).to(dtype) for _ in range(2))
    v = torch.randn(total, HV, DV, generator=gen).to(dtype)
    g = -torch.rand(total, HV, generator=gen) * 0.5
    beta = torch.rand(total, HV, generator=gen).to(dtype)
    return (q, k, v, g, beta), torch.randn(13, HV, DK, DV, generator=gen) * 0.1


def test_verification_rows_keep_the_state_after_each_token() -> None:
    """A verification row's outputs and kept states are those of decoding its tokens one at a time; its final state
    goes to its own slot, as for any row; the other rows are unaffected."""
    inputs, states = _verify_inputs()
    before = states.clone()
    out = gated_delta_rule(*inputs, states, _verify_batch())
    start = 0
    for (n, initial, keep), slot in zip(VERIFY_SEQUENCES, VERIFY_SLOTS):
        if keep is not None:
            one = before.clone()
            for t in range(n):  # one decode row at a time, in slot `slot`
                row = [x[start + t : start + t + 1] for x in inputs]
                torch.testing.assert_close(gated_delta_rule(*row, one, _batch([1], [slot], [True]))[0],
                                           out[start + t], atol=1e-6, rtol=1e-6)
                want = one[slot]
                torch.testing.assert_close(states[keep[t]] if keep[t] >= 0 else states[slot], want, atol=1e-6,
                                           rtol=1e-6)
        start += n
    conv_x = torch.randn(sum(n for n, _, _ in VERIFY_SEQUENCES), 12, generator=torch.Generator().manual_seed(7))
    weight = torch.randn(12, KERNEL)
    conv_state = torch.randn(13, 12, KERNEL - 1)
    conv_before = conv_state.clone()
    conv_out = causal_conv1d(conv_x, weight, conv_state, _verify_batch())
    start = 0
    for (n, initial, keep), slot in zip(VERIFY_SEQUENCES, VERIFY_SLOTS):
        history = conv_before[slot] if initial else torch.zeros(12, KERNEL - 1)
        full = torch.cat([history, conv_x[start:start + n].T], dim=-1)
        want = F.silu(F.conv1d(full[None], weight[:, None], groups=12))[0].T
        torch.testing.assert_close(conv_out[start:start + n], want, atol=1e-5, rtol=1e-5)
        for t, kept in enumerate(keep or []):
            torch.testing.assert_close(conv_state[kept if kept >= 0 else slot], full[:, t + 1 : t + KERNEL])
        start += n


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.slow)])
@pytest.mark.slow
def test_triton_verification_rows_match_reference(dtype: torch.dtype) -> None:
    inputs, states = _verify_inputs(dtype)
    want_states = states.clone()
    want = gated_delta_rule(*inputs, want_states, _verify_batch())
    got_states = states.to(DEVICE)
    got = get_ops("triton").gated_delta_rule(*(x.to(DEVICE) for x in inputs), got_states, _verify_batch(DEVICE))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.cpu(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(got_states.cpu(), want_states, atol=1e-5 if dtype == torch.float32 else 1e-2, rtol=1e-5)
    x = torch.randn(len(want), 130, generator=torch.Generator().manual_seed(8)).to(dtype)
    weight = torch.randn(130, KERNEL).to(dtype)
    conv_state = torch.randn(13, 130, KERNEL - 1).to(dtype)
    want_conv = conv_state.clone()
    want_out = causal_conv1d(x, weight, want_conv, _verify_batch())
    got_conv = conv_state.to(DEVICE)
    got_out = get_ops("triton").causal_conv1d(x.to(DEVICE), weight.to(DEVICE), got_conv, _verify_batch(DEVICE))
    torch.testing.assert_close(got_out.cpu(), want_out, atol=tol * 3, rtol=tol * 3)
    torch.testing.assert_close(got_conv.cpu(), want_conv, atol=0, rtol=0)
