"""Token sampling for one batch of logits.

Order of operations (the vLLM / OpenAI order): repetition penalty, presence and frequency penalties, then for
non-greedy rows temperature, top-k, top-p, min-p and the random draw. Greedy rows take the argmax of the penalized
logits. Everything is vectorized over the batch with per-row parameter tensors; the only per-row Python work is one
noise draw per seeded row (each seeded row owns a generator, which is what makes a seed reproducible whatever else
shares the batch).

Logprobs are taken from the model's raw distribution, ``log_softmax(logits)`` *before* penalties and temperature,
so they describe what the model predicted rather than the sampling transform applied to it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from engine.sampling_params import SamplingParams


class SampleContext(Protocol):
    """What the sampler needs from each row; the engine's request objects satisfy it."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the top-N alternatives (token id, logprob), best first


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # None for rows that did not ask for logprobs


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A generator for one seeded request, living on the device its logits live on."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def sample(logits: torch.Tensor, rows: Sequence[SampleContext]) -> SamplerOutput:
    """Pick one token per row of ``logits`` ([B, V]) with each row's sampling parameters."""
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits must be [len(rows), vocab], got {tuple(logits.shape)} for {len(rows)} rows")
    logits = logits.float()
    params = [row.params for row in rows]

    if all(p.greedy and not _has_penalties(p) for p in params):
        token_ids = logits.argmax(dim=-1)  # fast path: one argmax for the whole batch
    else:
        token_ids = _sample_general(logits, rows)

    token_list = token_ids.tolist()
    return SamplerOutput(token_ids=token_list, logprobs=_gather_logprobs(logits, token_ids, token_list, params))


def _has_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _sample_general(logits: torch.Tensor, rows: Sequence[SampleContext]) -> torch.Tensor:
    params = [row.params for row in rows]
    if any(_has_penalties(p) for p in params):
        logits = apply_penalties(logits, rows)
    token_ids = logits.argmax(dim=-1)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if random_rows:
        index = torch.tensor(random_rows, device=logits.device)
        sub_rows = [rows[i] for i in random_rows]
        probs = _sampling_probs(_select_rows(logits, index), [row.params for row in sub_rows])
        token_ids[index] = _draw(probs, [row.generator for row in sub_rows])
    return token_ids


def apply_penalties(logits: torch.Tensor, rows: Sequence[SampleContext]) -> torch.Tensor:
    """Return penalized logits (a new tensor).

    Repetition penalty (HF semantics) over prompt + output tokens: positive logits are divided by it, negative
    ones multiplied. Presence and frequency penalties (OpenAI semantics) over output tokens only:
    ``logit -= frequency * count + presence * (count > 0)``.
    """
    vocab = logits.shape[1]
    device = logits.device
    repetition = torch.tensor([row.params.repetition_penalty for row in rows], device=device).unsqueeze(1)
    presence = torch.tensor([row.params.presence_penalty for row in rows], device=device).unsqueeze(1)
    frequency = torch.tensor([row.params.frequency_penalty for row in rows], device=device).unsqueeze(1)

    output_counts = _token_counts([row.output_token_ids for row in rows], vocab, device)
    # Only rows with a repetition penalty look at their prompt; skipping the rest keeps long prompts cheap.
    prompts = [row.prompt_token_ids if row.params.repetition_penalty != 1.0 else [] for row in rows]
    seen = _token_counts(prompts, vocab, device) + output_counts > 0
    penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, penalized, logits)
    return logits - frequency * output_counts - presence * (output_counts > 0).float()


def _token_counts(token_lists: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[B, V] float counts of each token id per row, built with one scatter over a padded id matrix."""
    width = max((len(ids) for ids in token_lists), default=0)
    # Padding points at an extra sink column that is dropped afterwards.
    padded = torch.full((len(token_lists), width), vocab, dtype=torch.long)
    for i, ids in enumerate(token_lists):
        padded[i, : len(ids)] = torch.as_tensor(ids, dtype=torch.long)
    padded = padded.to(device)
    counts = torch.zeros(len(token_lists), vocab + 1, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=counts.dtype))
    return counts[:, :vocab]


def _sampling_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p masks; returns the normalized distribution to draw from."""
    temperature = torch.tensor([p.temperature for p in params], device=logits.device).unsqueeze(1)
    logits = logits / temperature
    if all(0 < p.top_k < logits.shape[1] for p in params):
        # Every row keeps at most max(top_k) tokens: filter those candidates only, so top-p sorts a few values
        # instead of the whole vocabulary. (Ties at the largest k-th value beyond the candidates are cut here.)
        values, candidates = logits.topk(max(p.top_k for p in params), dim=-1)
        filtered = torch.full_like(logits, float("-inf"))
        logits = filtered.scatter_(1, candidates, _apply_filters(values, params))
    else:
        logits = _apply_filters(logits, params)
    return logits.softmax(dim=-1)


def _apply_filters(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    device = logits.device
    if any(p.top_k > 0 for p in params):
        logits = _apply_top_k(logits, [p.top_k for p in params])
    if any(p.top_p < 1.0 for p in params):
        logits = _apply_top_p(logits, torch.tensor([p.top_p for p in params], device=device))
    if any(p.min_p > 0.0 for p in params):
        logits = _apply_min_p(logits, torch.tensor([p.min_p for p in params], device=device))
    return logits


def _select_rows(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """t[index] along dim 0, without copying a [B, V] tensor when index is every row in order."""
    return t if len(index) == t.shape[0] else t.index_select(0, index)


def _apply_top_k(logits: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    """Keep tokens whose logit is >= the k-th largest (ties at the boundary are kept, as in HF)."""
    vocab = logits.shape[1]
    ks = [min(k, vocab) if k > 0 else 0 for k in top_k]  # 0 marks "disabled" (top_k 0 or -1)
    top_values = logits.topk(max(ks), dim=-1).values
    k = torch.tensor(ks, device=logits.device)
    kth = top_values.gather(1, (k - 1).clamp(min=0).unsqueeze(1))
    kth = torch.where(k.unsqueeze(1) > 0, kth, torch.full_like(kth, float("-inf")))
    return logits.masked_fill(logits < kth, float("-inf"))


def _apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Nucleus: keep the smallest most-likely set whose mass reaches top_p (at least one token).

    The kept set is expressed as a probability cutoff, so tokens tied with the last kept one are kept too and the
    result does not depend on how the sort orders ties.
    """
    probs = logits.softmax(dim=-1)
    sorted_probs = probs.sort(dim=-1, descending=True).values
    cumulative = sorted_probs.cumsum(dim=-1)
    keep = (cumulative < top_p.unsqueeze(1)).sum(dim=-1).clamp(max=probs.shape[1] - 1)  # index of last kept
    cutoff = sorted_probs.gather(1, keep.unsqueeze(1))
    # Rows with top_p == 1 keep everything; float rounding in the cumsum must not trim their tail.
    cutoff = torch.where(top_p.unsqueeze(1) < 1.0, cutoff, torch.zeros_like(cutoff))
    return logits.masked_fill(probs < cutoff, float("-inf"))


def _apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the most likely token's."""
    probs = logits.softmax(dim=-1)
    threshold = min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, float("-inf"))


def _draw(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One draw per row by the exponential race: argmax(p / E) with E ~ Exp(1) picks index i with probability p_i.

    Seeded rows fill their noise from their own generator; the rest share the default generator in one call.
    """
    noise = torch.empty_like(probs)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        index = torch.tensor(unseeded, device=probs.device)
        noise[index] = torch.empty(len(unseeded), probs.shape[1], device=probs.device).exponential_()
    for i, generator in enumerate(generators):
        if generator is not None:
            noise[i].exponential_(generator=generator)
    # Exp(1) can round to exactly 0; a zero would turn a zero-probability token into 0/0 = nan.
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    return (probs / noise).argmax(dim=-1)


def _gather_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, token_list: list[int], params: Sequence[SamplingParams]
) -> list[TokenLogprobs | None]:
    wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
    result: list[TokenLogprobs | None] = [None] * len(params)
    if not wanted:
        return result
    index = torch.tensor(wanted, device=logits.device)
    logprobs = _select_rows(logits, index).log_softmax(dim=-1)
    chosen = logprobs.gather(1, _select_rows(token_ids, index).unsqueeze(1)).squeeze(1).tolist()
    top_n = max(params[i].logprobs or 0 for i in wanted)
    top = logprobs.topk(top_n, dim=-1) if top_n else None
    top_values = top.values.tolist() if top is not None else [[] for _ in wanted]
    top_ids = top.indices.tolist() if top is not None else [[] for _ in wanted]
    for j, i in enumerate(wanted):
        n = params[i].logprobs or 0
        result[i] = TokenLogprobs(
            token_id=token_list[i],
            logprob=chosen[j],
            # Tokens a grammar ruled out (-inf) are no alternatives; -inf is not valid JSON either.
            top=[(t, v) for t, v in zip(top_ids[j][:n], top_values[j][:n]) if v != float("-inf")],
        )
    return result
