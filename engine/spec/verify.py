"""The runner's side of speculative decoding: from the logits of a row's last token and its drafts (one forward),
the tokens the row emits, by the exact rules of `acceptance.py`.

A row with ``d`` drafts has ``d + 1`` logit rows. Greedy rows compare the drafts with the argmax chain; sampled rows
get each position's sampling distribution (temperature, top-k, top-p, min-p: the sampler's own transform) and run
the rejection rule, with their randomness drawn from the row's own generator when it is seeded.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.worker.sampler import SamplingBatch, draw_noise_width, sampling_probs
from engine.sampling_params import SamplingParams
from engine.spec.acceptance import accept_greedy, rejection_sample


def _padded(logits: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    """[R, kmax + 1, V] from the flat per-row logit rows (padding repeats a row's last position)."""
    kmax = max(counts)
    starts = torch.tensor([0, *counts[:-1]], device=logits.device).cumsum(0)
    offsets = torch.arange(kmax, device=logits.device).unsqueeze(0)
    last = torch.tensor(counts, device=logits.device).unsqueeze(1) - 1
    return logits[starts.unsqueeze(1) + torch.minimum(offsets, last)]


def verify(logits: torch.Tensor, drafts: Sequence[Sequence[int]], params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None]) -> list[list[int]]:
    """``logits``: the rows' logit rows one after another, ``len(drafts[r]) + 1`` per row; returns each row's
    emitted tokens (its accepted drafts, then one of the target's own)."""
    counts = [len(d) + 1 for d in drafts]
    kmax = max(counts) - 1
    device = logits.device
    target = _padded(logits.float(), counts)  # [R, kmax + 1, V]
    draft_ids = torch.tensor([list(d) + [-1] * (kmax - len(d)) for d in drafts], dtype=torch.long, device=device)
    num_drafts = torch.tensor([len(d) for d in drafts], device=device)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    emitted: list[list[int]] = [[] for _ in drafts]
    if greedy:
        index = torch.tensor(greedy, device=device)
        result = accept_greedy(draft_ids[index], num_drafts[index], target[index].argmax(dim=-1))
        _collect(emitted, greedy, result.token_ids, result.num_emitted)
    if sampled:
        index = torch.tensor(sampled, device=device)
        rows = target[index]  # [S, kmax + 1, V]
        vocab = rows.shape[-1]
        expanded = [params[i] for i in sampled for _ in range(kmax + 1)]
        probs = sampling_probs(rows.reshape(-1, vocab), SamplingBatch(expanded, [None] * len(expanded), device))
        uniforms = torch.empty(len(sampled), kmax, device=device)
        noise = torch.empty(len(sampled), draw_noise_width(vocab), device=device)
        for j, i in enumerate(sampled):  # each row's randomness from its own generator (seeded requests)
            uniforms[j].uniform_(generator=generators[i])
            noise[j].exponential_(generator=generators[i])
        result = rejection_sample(draft_ids[index], num_drafts[index], probs.view(len(sampled), kmax + 1, vocab),
                                  uniforms, noise)
        _collect(emitted, sampled, result.token_ids, result.num_emitted)
    return emitted


def _collect(emitted: list[list[int]], rows: list[int], token_ids: torch.Tensor, num_emitted: torch.Tensor) -> None:
    for i, tokens, n in zip(rows, token_ids.tolist(), num_emitted.tolist()):
        emitted[i] = tokens[:n]
