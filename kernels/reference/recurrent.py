"""Pure-torch reference ops of the recurrent (linear-attention) layers: the causal depthwise conv1d and the gated
delta rule of Gated DeltaNet (Qwen3-Next, Qwen3.5 / 3.6; a decay per head and token) and of Kimi Delta Attention
(Kimi Linear; a decay per head, key channel and token), over the flattened batch of one step.

Each sequence's recurrent state lives in a *state row*: row ``slot`` of the layer's ``conv_state``
``[num_rows, C, K - 1]`` (the last K - 1 conv inputs, model dtype) and ``ssm_state`` ``[num_rows, Hv, Dk, Dv]``
(fp32). A sequence with ``has_initial_state`` continues from its slot (a previous chunk, or a snapshot copied in
at admission); one without starts from zeros. Both ops write the state after the sequence's last new token back
into its slot. A prefill chunk runs the chunked form of the delta rule, a lone decode token the recurrent form;
decode rows are computed together. A verification row of speculative decoding (a token and its drafts, with
``batch.token_state_rows``) runs the recurrent form token by token and also writes the state after each of its
tokens to the slot given for it, so the state after the last accepted draft can be kept.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from kernels.attention_metadata import StateBatch

CHUNK = 64  # tokens per chunk of the chunked delta rule (as FLA and transformers)
L2NORM_EPS = 1e-6


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, batch: StateBatch) -> torch.Tensor:
    """SiLU(depthwise causal conv) of ``x`` ``[T, C]`` with ``weight`` ``[C, K]``, each sequence continuing the
    inputs kept in its slot of ``conv_state`` ``[S, C, K - 1]``; updates the slots."""
    out = torch.empty_like(x)
    kernel = weight.shape[1]
    decode = batch.decode_rows
    if len(decode):
        rows = torch.from_numpy(batch.host_starts[decode]).to(x.device).long()
        slots = torch.from_numpy(batch.host_slots[decode]).to(x.device).long()
        window = torch.cat([conv_state[slots], x[rows].unsqueeze(-1).to(conv_state.dtype)], dim=-1)  # [B, C, K]
        out[rows] = F.silu((window.to(weight.dtype) * weight).sum(-1)).to(x.dtype)
        conv_state[slots] = window[..., 1:]
    token_slots = batch.host_token_state_rows
    for b in np.union1d(batch.prefill_rows, batch.stepwise_rows).tolist():
        start, end, slot = int(batch.host_starts[b]), int(batch.host_starts[b + 1]), int(batch.host_slots[b])
        history = conv_state[slot] if batch.host_has_initial[b] else conv_state.new_zeros(conv_state.shape[1:])
        padded = torch.cat([history, x[start:end].T.to(conv_state.dtype)], dim=-1)  # [C, K - 1 + L]
        length = end - start
        acc = sum(padded[:, j : j + length].to(weight.dtype) * weight[:, j : j + 1] for j in range(kernel))
        out[start:end] = F.silu(acc).T.to(x.dtype)
        if token_slots is not None:  # a verification row: the window after each token too
            for t, keep in enumerate(token_slots[start:end].tolist()):
                if keep >= 0:
                    conv_state[keep] = padded[:, t + 1 : t + kernel]
        conv_state[slot] = padded[:, length:]
    return out


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    batch: StateBatch,
) -> torch.Tensor:
    """The gated delta rule with L2-normalised q/k: per value head, ``S = diag(exp(g_t)) S``; ``S += k_t (beta_t
    (v_t - S^T k_t))^T``; ``o_t = S^T q_t / sqrt(Dk)``.

    ``q``, ``k`` ``[T, Hk, Dk]``, ``v`` ``[T, Hv, Dv]`` (value head h reads key head ``h // (Hv / Hk)``), ``g`` (log
    decay, <= 0) ``[T, Hv]`` (Gated DeltaNet: one decay per head) or ``[T, Hv, Dk]`` (KDA: one per key channel),
    ``beta`` ``[T, Hv]``; ``ssm_state`` ``[S, Hv, Dk, Dv]`` fp32. Returns ``[T, Hv, Dv]`` in ``v``'s dtype; every
    sequence's final state is written back to its slot."""
    groups = v.shape[1] // k.shape[1]
    scale = k.shape[-1] ** -0.5
    qf = _l2norm(q.float()).repeat_interleave(groups, dim=1) * scale
    kf = _l2norm(k.float()).repeat_interleave(groups, dim=1)
    # [T, Hv, G]: G = 1 (a decay per head) or Dk (per channel); it broadcasts over the state's key rows
    vf, gf, bf = v.float(), g.float() if g.dim() == 3 else g.float()[..., None], beta.float()
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    decode = batch.decode_rows
    if len(decode):
        rows = torch.from_numpy(batch.host_starts[decode]).to(v.device).long()
        slots = torch.from_numpy(batch.host_slots[decode]).to(v.device).long()
        ssm_state[slots], out[rows] = _recurrent_step(ssm_state[slots], qf[rows], kf[rows], vf[rows], gf[rows],
                                                      bf[rows])
    for b in batch.prefill_rows.tolist():
        start, end, slot = int(batch.host_starts[b]), int(batch.host_starts[b + 1]), int(batch.host_slots[b])
        initial = ssm_state[slot] if batch.host_has_initial[b] else None
        out[start:end], ssm_state[slot] = _chunked(qf[start:end], kf[start:end], vf[start:end], gf[start:end],
                                                   bf[start:end], initial)
    for b in batch.stepwise_rows.tolist():  # verification rows: token by token, keeping each state asked for
        start, end, slot = int(batch.host_starts[b]), int(batch.host_starts[b + 1]), int(batch.host_slots[b])
        state = ssm_state[slot] if batch.host_has_initial[b] else ssm_state.new_zeros(ssm_state.shape[1:])
        for t, keep in zip(range(start, end), batch.host_token_state_rows[start:end].tolist()):
            state, out[t] = _recurrent_step(state, qf[t], kf[t], vf[t], gf[t], bf[t])
            if keep >= 0:
                ssm_state[keep] = state
        ssm_state[slot] = state
    return out.to(v.dtype)


def _recurrent_step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the delta rule (any leading batch dims; ``q`` already scaled; ``g`` ``[..., Hv, 1 or Dk]``):
    the new state ``[..., Hv, Dk, Dv]`` and the output ``[..., Hv, Dv]``."""
    state = state * g.exp()[..., None]
    delta = (v - (state * k[..., None]).sum(-2)) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return state, (state * q[..., None]).sum(-2)


def _chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             initial: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, chunk by chunk (fp32): within a chunk the delta-rule updates are folded into one triangular
    solve (the UT transform), between chunks the state carries over. ``q`` is already scaled; ``g`` ``[L, Hv, G]``
    (G = 1 or Dk). Returns the outputs ``[L, Hv, Dv]`` and the final state ``[Hv, Dk, Dv]``."""
    length, heads, dk = k.shape
    dv = v.shape[-1]
    pad = (-length) % CHUNK
    # [H, N, C, ...]: heads first, then chunks of CHUNK tokens (padding: zero k/v/beta, zero decay, no effect)
    q, k, v, g = (F.pad(x, (0, 0, 0, 0, 0, pad)).transpose(0, 1).reshape(heads, -1, CHUNK, x.shape[-1])
                  for x in (q, k, v, g))
    beta = F.pad(beta, (0, 0, 0, pad)).T.reshape(heads, -1, CHUNK)
    decay = g.cumsum(-2)  # log of the decay from the chunk's start to each position [H, N, C, G]
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    # (I + strictly lower part) u = v_beta: the solve reads the lower triangle and takes its diagonal as 1
    system = _decayed_products(k_beta, k, decay)
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * decay.exp(), upper=False, unitriangular=True)
    attn = _decayed_products(q, k, decay)
    q_decayed = q * decay.exp()
    k_to_end = k * (decay[..., -1:, :] - decay).exp()
    state = initial.clone() if initial is not None else q.new_zeros(heads, dk, dv)
    out = torch.empty(heads, q.shape[1], CHUNK, dv, device=q.device)
    for i in range(q.shape[1]):
        v_new = u[:, i] - w[:, i] @ state  # the part of the chunk's values the carried state does not predict
        out[:, i] = q_decayed[:, i] @ state + attn[:, i] @ v_new
        state = state * decay[:, i, -1].exp()[..., None] + k_to_end[:, i].transpose(-1, -2) @ v_new
    return out.reshape(heads, -1, dv)[:, :length].transpose(0, 1), state


def _decayed_products(a: torch.Tensor, b: torch.Tensor, decay: torch.Tensor) -> torch.Tensor:
    """``[..., C, C]``: ``sum_d a_i[d] b_j[d] exp(decay_i[d] - decay_j[d])`` for ``i >= j``, 0 above the diagonal.
    A decay per head (G = 1) factors out of the dot product; a decay per channel (KDA) is applied channel by
    channel, never as ``exp(decay_i) * exp(-decay_j)``, whose second factor overflows over a long chunk."""
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=a.device).tril()
    if decay.shape[-1] == 1:
        pair = (decay[..., :, None, 0] - decay[..., None, :, 0]).masked_fill(~causal, float("-inf")).exp()
        return (a @ b.transpose(-1, -2)) * pair
    pair = (decay[..., :, None, :] - decay[..., None, :, :]).masked_fill(~causal[..., None], float("-inf")).exp()
    return (a[..., :, None, :] * b[..., None, :, :] * pair).sum(-1)
