"""Exact acceptance of draft tokens, vectorized over a batch of rows, each with up to `k` drafts.

The target model scores a row's last token and its drafts in one forward, giving `k + 1` distributions: position
`i` predicts the token after draft `i - 1`. A row emits its accepted drafts plus one token of the target's own (the
correction at the first rejection, or the bonus token after the last draft), so every step emits 1 to k + 1 tokens.

- Greedy rows accept a draft iff it equals the target's argmax; the emitted tokens are then exactly the argmax
  chain the target produces one token at a time.
- Sampled rows use the standard rejection rule (Leviathan et al. 2023; Chen et al. 2023): accept draft `x` drawn from
  `q` with probability `min(1, p(x) / q(x))`; at the first rejection draw from `norm(max(p - q, 0))`. Each emitted
  token is then distributed exactly as under `p`, the target's sampling distribution. Model-free proposers are
  deterministic: `q` is one-hot at the draft, so a draft is accepted with probability `p(x)` and a rejection draws
  from `p` with `x` removed.

The functions take their randomness as arguments (uniforms, and exponential noise for `draw_from`), so they are
pure: the caller draws it from each row's generator (seeded requests stay reproducible) and tests can drive them
deterministically.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.worker.sampler import draw_from


@dataclass
class Acceptance:
    """Per row: `token_ids[b, :num_emitted[b]]` are the tokens to append (accepted drafts, then the target's)."""

    token_ids: torch.Tensor  # [B, k + 1]
    num_accepted: torch.Tensor  # [B] drafts accepted (0..num_drafts)

    @property
    def num_emitted(self) -> torch.Tensor:
        return self.num_accepted + 1


def _leading_true(accepted: torch.Tensor, num_drafts: torch.Tensor) -> torch.Tensor:
    """How many of each row's first drafts are accepted in a row (positions past `num_drafts` never count)."""
    k = accepted.shape[1]
    valid = torch.arange(k, device=accepted.device).unsqueeze(0) < num_drafts.unsqueeze(1)
    return (accepted & valid).long().cumprod(dim=1).sum(dim=1)


def _emit(draft_ids: torch.Tensor, num_accepted: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """[B, k + 1]: the accepted drafts, then `last` at position num_accepted (what follows is padding, -1)."""
    batch, k = draft_ids.shape
    positions = torch.arange(k + 1, device=draft_ids.device).unsqueeze(0)
    out = torch.full((batch, k + 1), -1, dtype=torch.long, device=draft_ids.device)
    out[:, :k] = torch.where(positions[:, :k] < num_accepted.unsqueeze(1), draft_ids, -1)
    return out.scatter_(1, num_accepted.unsqueeze(1), last.long().unsqueeze(1))


def accept_greedy(draft_ids: torch.Tensor, num_drafts: torch.Tensor, target_ids: torch.Tensor) -> Acceptance:
    """`draft_ids` [B, k] (padding past `num_drafts` [B] is ignored), `target_ids` [B, k + 1]: the target's argmax
    at each position. Emits the target's tokens up to and including its first disagreement with the drafts."""
    num_accepted = _leading_true(draft_ids == target_ids[:, :-1], num_drafts)
    last = target_ids.gather(1, num_accepted.unsqueeze(1)).squeeze(1)
    return Acceptance(_emit(draft_ids, num_accepted, last), num_accepted)


def rejection_sample(
    draft_ids: torch.Tensor,
    num_drafts: torch.Tensor,
    target_probs: torch.Tensor,
    uniforms: torch.Tensor,
    noise: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
) -> Acceptance:
    """The rejection rule for sampled rows.

    draft_ids [B, k], num_drafts [B]; target_probs [B, k + 1, V]: the target's sampling distribution at each position
    (after temperature, top-k/p, min-p); uniforms [B, k] in [0, 1); noise [B, draw_noise_width(V)] ~ Exp(1) for
    the one token each row draws itself (`draw_from`); draft_probs [B, k, V] for a proposer that samples (None:
    deterministic drafts, q one-hot).
    """
    batch, k = draft_ids.shape
    safe_drafts = draft_ids.clamp(min=0).long()
    p_draft = target_probs[:, :k].gather(2, safe_drafts.unsqueeze(2)).squeeze(2)
    if draft_probs is None:
        accepted = uniforms < p_draft  # q(x) = 1
    else:
        q_draft = draft_probs.gather(2, safe_drafts.unsqueeze(2)).squeeze(2)
        accepted = uniforms * q_draft < p_draft  # u < p / q, without dividing by a zero q
    num_accepted = _leading_true(accepted, num_drafts)

    rows = torch.arange(batch, device=draft_ids.device)
    p = target_probs[rows, num_accepted]  # [B, V] the distribution where the row draws its own token
    rejected = num_accepted < num_drafts  # else: every draft accepted, the bonus token is drawn from p itself
    residual = p
    if k:
        at = num_accepted.clamp(max=k - 1)  # the rejected draft's position (rows that rejected nothing: unused)
        if draft_probs is None:
            q = torch.zeros_like(p).scatter_(1, safe_drafts.gather(1, at.unsqueeze(1)), 1.0)
        else:
            q = draft_probs[rows, at]
        residual = torch.where(rejected.unsqueeze(1), (p - q).clamp(min=0), p)
    # A rejection has residual mass > 0 in exact arithmetic; rounding could leave none, and then p itself is exact.
    residual = torch.where(residual.sum(dim=1, keepdim=True) > 0, residual, p)
    last = draw_from(residual, noise)  # ~ residual
    return Acceptance(_emit(draft_ids, num_accepted, last), num_accepted)
