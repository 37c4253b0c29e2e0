"""Triton kernels of Gated DeltaNet's and Kimi Delta Attention's recurrent ops (``kernels.reference.recurrent``),
reading and writing each sequence's state in place in its slot.

- ``causal_conv1d``: one program per (sequence, tile of channels) walks the sequence's tokens in tiles; the first
  K - 1 inputs before the sequence's new tokens come from its slot's conv window (zeros for a fresh sequence), and
  the last K - 1 inputs become the new window.
- ``gated_delta_rule``: one-token rows run the **fused recurrent** form (one program per sequence, value head and
  tile of value dims, the ``[Dk, BV]`` state in registers). Longer rows run the **chunked** form in two kernels:
  ``_chunk_prepare`` (parallel over 64-token chunks and heads) folds each chunk's delta-rule updates into the UT
  transform ``T = (I + strictly_lower(beta K K^T * decay))^-1`` by forward substitution and stores
  ``w = T (beta k exp(g_cum))``, ``u = T (beta v)`` and the cumulative log decay; ``_chunk_scan`` (one program per
  sequence, value head and tile of value dims) carries the state from chunk to chunk and writes the outputs.
  KDA (a decay per key channel, ``g`` ``[T, H, Dk]``): the recurrent form scales each row of the state by its
  channel's decay; the chunked form keeps ``[BT, Dk]`` cumulative decays and sums the decayed products within a
  chunk over slices of 16 channels (`_channel_decayed_products`), never factoring ``exp(g_i - g_j)``.

Every launch is sized by the batch's row count and (for the chunked form) its longest row, and reads offsets, slots
and initial-state flags from the device, so the decode path needs no host data and replays under CUDA graphs. A row
whose slot is < 0 is padding: nothing is read or written for it. q and k are L2-normalised inside the kernels;
value head ``h`` reads key head ``h // (Hv / Hk)``. State math is fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention_metadata import StateBatch
from kernels.reference.recurrent import CHUNK, L2NORM_EPS

BLOCK_T_CONV = 16
BLOCK_C_CONV = 128
BLOCK_V = 32  # value dims per program of the recurrent and scan kernels
# The chunked kernels hold several [64, 128] fp32 tiles at once; 8 warps halve each thread's share of a tile (sm_90,
# Qwen3.6 shapes, `python -m kernels.triton.aot`: with TF32 dots 384 / 840 bytes of stack a thread, 2.1 / 3.4 KB
# over 4 warps).
CHUNK_WARPS = 8


@triton.jit
def _row(qsl_ptr, slots_ptr, init_ptr, tok_slots_ptr, seq, MIN_LEN, MAX_LEN, STEPWISE: tl.constexpr,
         PER_TOKEN: tl.constexpr):
    """(first token, tokens to process, slot, continues a state) of sequence ``seq``; 0 tokens for padding rows
    (slot < 0) and rows outside ``[MIN_LEN, MAX_LEN]``. With ``PER_TOKEN`` (a step with verification rows: those
    whose first token has a state row of its own), verification rows are taken whatever their length where
    ``STEPWISE`` (the recurrent kernel) and never elsewhere."""
    start = tl.load(qsl_ptr + seq)
    length = tl.load(qsl_ptr + seq + 1) - start
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    in_range = (length >= MIN_LEN) & (length <= MAX_LEN)
    if PER_TOKEN:
        verifies = (length > 0) & (tl.load(tok_slots_ptr + start, mask=length > 0, other=-1) >= 0)
        if STEPWISE:
            in_range = in_range | verifies
        else:
            in_range = in_range & (verifies == 0)
    length = tl.where((slot >= 0) & in_range, length, 0)
    has_initial = tl.load(init_ptr + seq).to(tl.int32) != 0
    return start.to(tl.int64), length, tl.maximum(slot, 0), has_initial


@triton.jit
def _window(x_ptr, state, start, end, history, cs, c_valid, stride_xt, KERNEL: tl.constexpr,
            BLOCK_K: tl.constexpr):
    """``[BLOCK_C, BLOCK_K]``: the last K - 1 inputs up to new token ``end`` (exclusive) of (old window, new
    tokens), in the state's dtype; ``history``: how many of the old window's inputs exist (K - 1 or none)."""
    ks = tl.arange(0, BLOCK_K)
    pos = end - (KERNEL - 1) + ks
    k_valid = ks < KERNEL - 1
    from_x = (pos >= 0) & k_valid
    from_state = (pos < 0) & (pos + history >= 0)
    xv = tl.load(x_ptr + (start + pos)[None, :] * stride_xt + cs[:, None], mask=c_valid[:, None] & from_x[None, :],
                 other=0.0)
    sv = tl.load(state[:, None] + (KERNEL - 1 + pos)[None, :], mask=c_valid[:, None] & from_state[None, :],
                 other=0.0)
    return xv.to(sv.dtype) + sv


@triton.jit
def _causal_conv1d_kernel(
    x_ptr, w_ptr, state_ptr, out_ptr, qsl_ptr, slots_ptr, init_ptr, tok_slots_ptr, channels,
    stride_xt, stride_wc, stride_ot, stride_ss, stride_sc,
    KERNEL: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
    PER_TOKEN: tl.constexpr,
):
    seq = tl.program_id(0)
    start, length, slot, has_initial = _row(qsl_ptr, slots_ptr, init_ptr, tok_slots_ptr, seq, 1, 2**30, True, False)
    cs = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_valid = cs < channels
    state = state_ptr + slot * stride_ss + cs * stride_sc  # this tile's channels of the slot's window
    # A scalar can't join a tensor mask under the interpreter: fold it into a bound (K - 1 old inputs, or none)
    history = tl.where(has_initial & (length > 0), KERNEL - 1, 0)
    written = tl.where(length > 0, KERNEL - 1, 0)
    for t0 in range(0, length, BLOCK_T):
        ts = t0 + tl.arange(0, BLOCK_T)
        acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
        for j in tl.static_range(KERNEL):
            pos = ts - (KERNEL - 1) + j  # the input this tap reads, relative to the first new token
            from_x = (pos >= 0) & (ts < length)
            from_state = (pos < 0) & (pos + history >= 0)
            xv = tl.load(x_ptr + (start + pos)[:, None] * stride_xt + cs[None, :],
                         mask=from_x[:, None] & c_valid[None, :], other=0.0).to(tl.float32)
            sv = tl.load(state[None, :] + (KERNEL - 1 + pos)[:, None], mask=from_state[:, None] & c_valid[None, :],
                         other=0.0).to(tl.float32)
            weight = tl.load(w_ptr + cs * stride_wc + j, mask=c_valid, other=0.0).to(tl.float32)
            acc += (xv + sv) * weight[None, :]
        out = acc / (1.0 + tl.exp(-acc))
        tl.store(out_ptr + (start + ts)[:, None] * stride_ot + cs[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=(ts < length)[:, None] & c_valid[None, :])
    ks = tl.arange(0, BLOCK_K)
    if PER_TOKEN:  # verification rows: the window after each token that has a slot of its own
        for t in range(0, length):
            keep = tl.load(tok_slots_ptr + start + t)
            if keep >= 0:
                window = _window(x_ptr, state, start, t + 1, history, cs, c_valid, stride_xt, KERNEL, BLOCK_K)
                tl.store(state_ptr + keep * stride_ss + cs[:, None] * stride_sc + ks[None, :], window,
                         mask=c_valid[:, None] & (ks < KERNEL - 1)[None, :])
    # The new window: the last K - 1 inputs of (old window, new tokens)
    window = _window(x_ptr, state, start, length, history, cs, c_valid, stride_xt, KERNEL, BLOCK_K)
    tl.debug_barrier()  # every read of the old window above happens before it is overwritten
    tl.store(state[:, None] + ks[None, :], window, mask=c_valid[:, None] & (ks < written)[None, :])


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, batch: StateBatch) -> torch.Tensor:
    """SiLU(depthwise causal conv) of ``x`` ``[T, C]`` with ``weight`` ``[C, K]``, each sequence continuing the
    window in its slot of ``conv_state`` ``[S, C, K - 1]``; updates the slots (as the reference)."""
    tokens, channels = x.shape
    kernel = weight.shape[1]
    assert x.stride(1) == 1 and weight.stride(1) == 1 and conv_state.stride(2) == 1
    out = torch.empty(tokens, channels, dtype=x.dtype, device=x.device)
    rows = batch.state_rows.shape[0]
    if rows == 0 or tokens == 0:
        return out
    per_token = batch.token_state_rows is not None
    _causal_conv1d_kernel[(rows, triton.cdiv(channels, BLOCK_C_CONV))](
        x, weight, conv_state, out, batch.query_start_loc, batch.state_rows, batch.has_initial_state,
        batch.token_state_rows if per_token else batch.state_rows, channels,
        x.stride(0), weight.stride(0), out.stride(0), conv_state.stride(0), conv_state.stride(1),
        KERNEL=kernel, BLOCK_T=BLOCK_T_CONV, BLOCK_C=BLOCK_C_CONV, BLOCK_K=triton.next_power_of_2(kernel - 1),
        PER_TOKEN=per_token,
    )
    return out


@triton.jit
def _fused_recurrent_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, out_ptr, qsl_ptr, slots_ptr, init_ptr, tok_slots_ptr, scale, eps,
    max_len, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_gh, stride_bt,
    stride_ot, stride_oh, stride_ss, stride_sh, stride_sk,
    GROUPS: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    PER_TOKEN: tl.constexpr, CHANNEL_GATE: tl.constexpr,
):
    seq, head = tl.program_id(0), tl.program_id(1)
    start, length, slot, has_initial = _row(qsl_ptr, slots_ptr, init_ptr, tok_slots_ptr, seq, 1, max_len, True,
                                            PER_TOKEN)
    key_head = head // GROUPS
    dk = tl.arange(0, BLOCK_K)
    dv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_valid, v_valid = dk < DK, dv < DV
    tile = state_ptr + slot * stride_ss + head * stride_sh + dk[:, None] * stride_sk + dv[None, :]
    # scalars folded into bounds (the interpreter takes no `tensor & scalar` mask)
    read = (dk < tl.where(has_initial & (length > 0), DK, 0))[:, None] & v_valid[None, :]
    written = (dk < tl.where(length > 0, DK, 0))[:, None] & v_valid[None, :]
    state = tl.load(tile, mask=read, other=0.0)
    for t in range(start, start + length):
        q = tl.load(q_ptr + t * stride_qt + key_head * stride_qh + dk, mask=k_valid, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + t * stride_kt + key_head * stride_kh + dk, mask=k_valid, other=0.0).to(tl.float32)
        q = q / tl.sqrt(tl.sum(q * q) + eps) * scale
        k = k / tl.sqrt(tl.sum(k * k) + eps)
        v = tl.load(v_ptr + t * stride_vt + head * stride_vh + dv, mask=v_valid, other=0.0).to(tl.float32)
        if CHANNEL_GATE:  # KDA: one decay per key channel, scaling the state's rows
            decay = tl.exp(tl.load(g_ptr + t * stride_gt + head * stride_gh + dk, mask=k_valid, other=0.0)
                           .to(tl.float32))[:, None]
        else:
            decay = tl.exp(tl.load(g_ptr + t * stride_gt + head * stride_gh).to(tl.float32))
        beta = tl.load(beta_ptr + t * stride_bt + head).to(tl.float32)
        state = state * decay
        delta = (v - tl.sum(state * k[:, None], axis=0)) * beta
        state = state + k[:, None] * delta[None, :]
        out = tl.sum(state * q[:, None], axis=0)
        tl.store(out_ptr + t * stride_ot + head * stride_oh + dv, out.to(out_ptr.dtype.element_ty), mask=v_valid)
        if PER_TOKEN:  # a verification row: the state after this token, where it has a slot of its own
            keep = tl.load(tok_slots_ptr + t)
            if keep >= 0:
                tl.store(tile + (keep - slot) * stride_ss, state, mask=written)
    tl.store(tile, state, mask=written)


@triton.jit
def _channel_decayed_products(a_rows, a_decay_rows, a_scale, a_row_gain, b_scale, b_rows, b_decay_rows, t_valid, keep,
                              DK: tl.constexpr, BLOCK_K: tl.constexpr, BT: tl.constexpr):
    """``[BT, BT]``: ``sum_d a_i[d] b_j[d] exp(c_i[d] - c_j[d])`` where ``keep``, else 0, with ``c`` the cumulative
    (over the chunk's tokens) decays read from ``*_decay_rows`` and ``a``, ``b`` rows scaled by ``a_scale *
    a_row_gain`` and ``b_scale``. Summed over slices of 16 channels: a decay per channel does not factor out of
    the dot product, and a ``[BT, BT, BLOCK_K]`` product would not fit in registers."""
    acc = tl.zeros((BT, BT), dtype=tl.float32)
    for d0 in tl.static_range(0, BLOCK_K, 16):
        ds = d0 + tl.arange(0, 16)
        mask = t_valid[:, None] & (ds < DK)[None, :]
        a = tl.load(a_rows + ds[None, :], mask=mask, other=0.0).to(tl.float32) * (a_scale * a_row_gain)[:, None]
        b = tl.load(b_rows + ds[None, :], mask=mask, other=0.0).to(tl.float32) * b_scale[:, None]
        ca = tl.cumsum(tl.load(a_decay_rows + ds[None, :], mask=mask, other=0.0).to(tl.float32), axis=0)
        cb = tl.cumsum(tl.load(b_decay_rows + ds[None, :], mask=mask, other=0.0).to(tl.float32), axis=0)
        gap = tl.where(keep[:, :, None], ca[:, None, :] - cb[None, :, :], 0.0)  # <= 0 where kept: no overflow
        acc += tl.sum(a[:, None, :] * b[None, :, :] * tl.exp(gap), axis=2)
    return tl.where(keep, acc, 0.0)


@triton.jit
def _chunk_prepare_kernel(
    k_ptr, v_ptr, g_ptr, beta_ptr, w_ptr, u_ptr, gcum_ptr, qsl_ptr, slots_ptr, init_ptr, tok_slots_ptr, eps,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_gh, stride_bt,
    stride_wt, stride_wh, stride_ut, stride_uh, stride_ct, stride_ch,
    GROUPS: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DV: tl.constexpr,
    BT: tl.constexpr, DOT_PRECISION: tl.constexpr, PER_TOKEN: tl.constexpr, CHANNEL_GATE: tl.constexpr,
):
    seq, chunk, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, length, slot, has_initial = _row(qsl_ptr, slots_ptr, init_ptr, tok_slots_ptr, seq, 2, 2**30, False,
                                            PER_TOKEN)
    if chunk * BT < length:
        ts = chunk * BT + tl.arange(0, BT)
        t_valid = ts < length
        rows = start + ts
        dk, dv = tl.arange(0, BLOCK_K), tl.arange(0, BLOCK_DV)
        k_rows = k_ptr + rows[:, None] * stride_kt + (head // GROUPS) * stride_kh
        k_mask = t_valid[:, None] & (dk < DK)[None, :]
        k = tl.load(k_rows + dk[None, :], mask=k_mask, other=0.0).to(tl.float32)
        inv_norm = 1.0 / tl.sqrt(tl.sum(k * k, axis=1) + eps)
        k = k * inv_norm[:, None]
        v = tl.load(v_ptr + rows[:, None] * stride_vt + head * stride_vh + dv[None, :],
                    mask=t_valid[:, None] & (dv < DV)[None, :], other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + rows * stride_bt + head, mask=t_valid, other=0.0).to(tl.float32)
        i, j = tl.arange(0, BT)[:, None], tl.arange(0, BT)[None, :]
        lower = (i > j) & t_valid[:, None] & t_valid[None, :]
        k_beta = k * beta[:, None]
        # -strictly_lower(sum_d beta_i k_i[d] k_j[d] exp(g_cum_i[d] - g_cum_j[d])): the chunk's updates as one system
        if CHANNEL_GATE:  # KDA: [BT, BK] cumulative decays, the products summed over slices of channels
            g_rows = g_ptr + rows[:, None] * stride_gt + head * stride_gh
            g_cum = tl.cumsum(tl.load(g_rows + dk[None, :], mask=k_mask, other=0.0).to(tl.float32), axis=0)
            neg_a = _channel_decayed_products(k_rows, g_rows, inv_norm, beta, inv_norm, k_rows, g_rows, t_valid,
                                              lower, DK, BLOCK_K, BT)
            decay = tl.exp(g_cum)
        else:
            g_cum = tl.cumsum(tl.load(g_ptr + rows * stride_gt + head * stride_gh, mask=t_valid, other=0.0)
                              .to(tl.float32), axis=0)
            neg_a = tl.where(lower, tl.dot(k_beta, tl.trans(k), input_precision=DOT_PRECISION), 0.0)
            neg_a = neg_a * tl.exp(tl.where(lower, g_cum[:, None] - g_cum[None, :], 0.0))
            decay = tl.exp(g_cum)[:, None]
        neg_a = -neg_a
        # Forward substitution: m = (I + A)^-1 - I row by row, m_i = -a_i + (-a_i) m (rows < i already solved)
        m = neg_a
        # Rows past the chunk's last token are zero in neg_a and stay zero: solve only the valid ones (a prompt's
        # last chunk, and every short prompt, fills a fraction of BT).
        for r in range(2, tl.minimum(length - chunk * BT, BT)):
            a_r = tl.sum(tl.where(i == r, neg_a, 0.0), axis=0)
            m_r = a_r + tl.sum(a_r[:, None] * m, axis=0)
            m = tl.where(i == r, m_r[None, :], m)
        t_inv = m + tl.where(i == j, 1.0, 0.0)
        u = tl.dot(t_inv, v * beta[:, None], input_precision=DOT_PRECISION)
        w = tl.dot(t_inv, k_beta * decay, input_precision=DOT_PRECISION)
        tl.store(u_ptr + rows[:, None] * stride_ut + head * stride_uh + dv[None, :], u,
                 mask=t_valid[:, None] & (dv < DV)[None, :])
        tl.store(w_ptr + rows[:, None] * stride_wt + head * stride_wh + dk[None, :], w,
                 mask=t_valid[:, None] & (dk < DK)[None, :])
        if CHANNEL_GATE:
            tl.store(gcum_ptr + rows[:, None] * stride_ct + head * stride_ch + dk[None, :], g_cum, mask=k_mask)
        else:
            tl.store(gcum_ptr + rows * stride_ct + head * stride_ch, g_cum, mask=t_valid)


@triton.jit
def _chunk_scan_kernel(
    q_ptr, k_ptr, g_ptr, w_ptr, u_ptr, gcum_ptr, state_ptr, out_ptr, qsl_ptr, slots_ptr, init_ptr, tok_slots_ptr,
    scale, eps, stride_qt, stride_qh, stride_kt, stride_kh, stride_gt, stride_gh, stride_wt, stride_wh, stride_ut,
    stride_uh, stride_ct, stride_ch, stride_ot, stride_oh, stride_ss, stride_sh, stride_sk,
    GROUPS: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    BT: tl.constexpr, DOT_PRECISION: tl.constexpr, PER_TOKEN: tl.constexpr, CHANNEL_GATE: tl.constexpr,
):
    seq, head = tl.program_id(0), tl.program_id(1)
    start, length, slot, has_initial = _row(qsl_ptr, slots_ptr, init_ptr, tok_slots_ptr, seq, 2, 2**30, False,
                                            PER_TOKEN)
    key_head = head // GROUPS
    dk = tl.arange(0, BLOCK_K)
    dv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_valid, v_valid = dk < DK, dv < DV
    tile = state_ptr + slot * stride_ss + head * stride_sh + dk[:, None] * stride_sk + dv[None, :]
    # scalars folded into bounds (the interpreter takes no `tensor & scalar` mask)
    read = (dk < tl.where(has_initial & (length > 0), DK, 0))[:, None] & v_valid[None, :]
    written = (dk < tl.where(length > 0, DK, 0))[:, None] & v_valid[None, :]
    state = tl.load(tile, mask=read, other=0.0)
    i, j = tl.arange(0, BT)[:, None], tl.arange(0, BT)[None, :]
    for c0 in range(0, length, BT):
        ts = c0 + tl.arange(0, BT)
        t_valid = ts < length
        rows = start + ts
        qk_mask = t_valid[:, None] & k_valid[None, :]
        q_rows = q_ptr + rows[:, None] * stride_qt + key_head * stride_qh
        k_rows = k_ptr + rows[:, None] * stride_kt + key_head * stride_kh
        q = tl.load(q_rows + dk[None, :], mask=qk_mask, other=0.0).to(tl.float32)
        k = tl.load(k_rows + dk[None, :], mask=qk_mask, other=0.0).to(tl.float32)
        q_scale = scale / tl.sqrt(tl.sum(q * q, axis=1) + eps)
        k_scale = 1.0 / tl.sqrt(tl.sum(k * k, axis=1) + eps)
        q, k = q * q_scale[:, None], k * k_scale[:, None]
        last = start + tl.minimum(c0 + BT, length) - 1
        w = tl.load(w_ptr + rows[:, None] * stride_wt + head * stride_wh + dk[None, :], mask=qk_mask, other=0.0)
        u = tl.load(u_ptr + rows[:, None] * stride_ut + head * stride_uh + dv[None, :],
                    mask=t_valid[:, None] & v_valid[None, :], other=0.0)
        # the part of the chunk's values the carried state does not predict
        v_new = u - tl.dot(w, state, input_precision=DOT_PRECISION)
        causal = (i >= j) & t_valid[:, None] & t_valid[None, :]
        if CHANNEL_GATE:  # KDA: decays [BT, BK] per channel
            g_cum = tl.load(gcum_ptr + rows[:, None] * stride_ct + head * stride_ch + dk[None, :], mask=qk_mask,
                            other=0.0)
            g_last = tl.load(gcum_ptr + last * stride_ct + head * stride_ch + dk, mask=k_valid, other=0.0)
            g_rows = g_ptr + rows[:, None] * stride_gt + head * stride_gh
            attn = _channel_decayed_products(q_rows, g_rows, q_scale, 1.0, k_scale, k_rows, g_rows, t_valid, causal,
                                             DK, BLOCK_K, BT)
            to_end = tl.where(qk_mask, g_last[None, :] - g_cum, 0.0)
            state_decay = tl.exp(g_last)[:, None]
        else:
            g_cum = tl.load(gcum_ptr + rows * stride_ct + head * stride_ch, mask=t_valid, other=0.0)
            g_last = tl.load(gcum_ptr + last * stride_ct + head * stride_ch)
            attn = tl.where(causal, tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION), 0.0)
            attn = attn * tl.exp(tl.where(causal, g_cum[:, None] - g_cum[None, :], 0.0))
            to_end = tl.where(t_valid, g_last - g_cum, 0.0)[:, None]
            g_cum = g_cum[:, None]
            state_decay = tl.exp(g_last)
        out = tl.dot(q * tl.exp(g_cum), state, input_precision=DOT_PRECISION)
        out += tl.dot(attn, v_new, input_precision=DOT_PRECISION)
        tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + dv[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=t_valid[:, None] & v_valid[None, :])
        k_to_end = k * tl.exp(to_end)
        state = state * state_decay + tl.dot(tl.trans(k_to_end), v_new, input_precision=DOT_PRECISION)
    tl.store(tile, state, mask=written)


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    batch: StateBatch,
) -> torch.Tensor:
    """The gated delta rule with L2-normalised q/k over each sequence's slot of ``ssm_state`` ``[S, Hv, Dk, Dv]``
    (fp32), as ``reference_recurrent.gated_delta_rule``: one-token rows in the recurrent form, longer rows in the
    chunked form; final states written back to the slots. Returns ``[T, Hv, Dv]`` in ``v``'s dtype."""
    tokens, num_k_heads, dk = k.shape
    num_v_heads, dv = v.shape[1:]
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
    assert ssm_state.dtype == torch.float32 and ssm_state.stride(-1) == 1
    out = torch.empty(tokens, num_v_heads, dv, dtype=v.dtype, device=v.device)
    rows = batch.state_rows.shape[0]
    if rows == 0 or tokens == 0:
        return out
    groups = num_v_heads // num_k_heads
    scale = dk ** -0.5
    block_k = max(16, triton.next_power_of_2(dk))
    block_v = min(BLOCK_V, max(16, triton.next_power_of_2(dv)))
    grid = (rows, num_v_heads, triton.cdiv(dv, block_v))
    per_token = batch.token_state_rows is not None  # verification rows: the recurrent form, every state kept
    row_args = (batch.query_start_loc, batch.state_rows, batch.has_initial_state,
                batch.token_state_rows if per_token else batch.state_rows)
    state_strides = (ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2))
    longest = batch.longest
    channel_gate = g.dim() == 3  # KDA: a decay per key channel
    _fused_recurrent_kernel[grid](
        q, k, v, g, beta, ssm_state, out, *row_args, scale, L2NORM_EPS, 1,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), g.stride(1),
        beta.stride(0), out.stride(0), out.stride(1), *state_strides,
        GROUPS=groups, DK=dk, DV=dv, BLOCK_K=block_k, BLOCK_V=block_v, PER_TOKEN=per_token, CHANNEL_GATE=channel_gate,
    )
    if longest < 2 or len(batch.prefill_rows) == 0:
        return out
    # fp32 inputs (tests, fp32 engines): exact fp32 products, as the reference. Half-precision models: TF32 tensor
    # cores (state and accumulators stay fp32), as attention and MoE do; the FMA form of these dots (``ieee``) left
    # ptxas 32 registers and tens of KB of spills a thread, which made a 16k-token prefill step take seconds.
    precision = "ieee" if v.dtype == torch.float32 else "tf32"
    # The scan's loads pipelined over 2 stages where that fits A100's 163 KiB of shared memory (Gated DeltaNet in
    # half precision: 161 KiB at head dims 128); fp32 inputs (185 KiB) and KDA (208 KiB) take 1 stage (104, 72 KiB).
    scan_stages = 2 if precision == "tf32" and not channel_gate else 1
    w = torch.empty(tokens, num_v_heads, dk, dtype=torch.float32, device=v.device)
    u = torch.empty(tokens, num_v_heads, dv, dtype=torch.float32, device=v.device)
    g_cum = torch.empty(g.shape, dtype=torch.float32, device=v.device)  # per head, or per head and channel
    _chunk_prepare_kernel[(rows, triton.cdiv(longest, CHUNK), num_v_heads)](
        k, v, g, beta, w, u, g_cum, *row_args, L2NORM_EPS,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), g.stride(1), beta.stride(0),
        w.stride(0), w.stride(1), u.stride(0), u.stride(1), g_cum.stride(0), g_cum.stride(1),
        GROUPS=groups, DK=dk, DV=dv, BLOCK_K=block_k, BLOCK_DV=max(16, triton.next_power_of_2(dv)), BT=CHUNK,
        DOT_PRECISION=precision, PER_TOKEN=per_token, CHANNEL_GATE=channel_gate, num_warps=CHUNK_WARPS,
    )
    _chunk_scan_kernel[grid](
        q, k, g, w, u, g_cum, ssm_state, out, *row_args, scale, L2NORM_EPS,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), g.stride(0), g.stride(1), w.stride(0), w.stride(1),
        u.stride(0), u.stride(1), g_cum.stride(0), g_cum.stride(1), out.stride(0), out.stride(1), *state_strides,
        GROUPS=groups, DK=dk, DV=dv, BLOCK_K=block_k, BLOCK_V=block_v, BT=CHUNK, DOT_PRECISION=precision,
        PER_TOKEN=per_token, CHANNEL_GATE=channel_gate, num_warps=CHUNK_WARPS, num_stages=scan_stages,
    )
    return out
