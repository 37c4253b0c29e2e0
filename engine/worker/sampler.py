"""Token sampling for one batch of logits, entirely on the logits' device: no host sync until the caller copies the
result back (once per step).

Order of operations (the vLLM / OpenAI order): repetition penalty, presence and frequency penalties, then for
non-greedy rows temperature, top-k, top-p, min-p and the random draw. Greedy rows take the argmax of the penalized
logits. Everything is vectorized over the batch with per-row parameter tensors, built once per batch composition
(`SamplingBatch`); the only per-row work is one noise draw per seeded row (each seeded row owns a generator, which is
what makes a seed reproducible whatever else shares the batch).

Logprobs are taken from the model's raw distribution, ``log_softmax(logits)`` *before* penalties and temperature,
so they describe what the model predicted rather than the sampling transform applied to it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from engine.outputs import TokenLogprobs
from engine.sampling_params import SamplingParams


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A generator for one seeded request, living on the device its logits live on."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def has_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


@dataclass
class Penalties:
    """Per-row penalty parameters ``[B, 1]`` and token histories ``[B, V]`` (rows without penalties are neutral)."""

    repetition: torch.Tensor
    presence: torch.Tensor
    frequency: torch.Tensor
    output_counts: torch.Tensor  # float counts of each token in the row's output so far
    prompt_seen: torch.Tensor  # bool: token occurs in the prompt (only filled for rows with a repetition penalty)

    @classmethod
    def from_histories(
        cls, params: Sequence[SamplingParams], prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]],
        vocab: int, device: torch.device | str,
    ) -> "Penalties":
        """From token lists (tests and one-off calls; the runner keeps the histories on the device instead)."""
        counts = torch.zeros(len(params), vocab, device=device)
        seen = torch.zeros(len(params), vocab, dtype=torch.bool, device=device)
        for i, (p, prompt, output) in enumerate(zip(params, prompts, outputs)):
            if output:
                counts[i].index_add_(0, torch.as_tensor(output, device=device), torch.ones(len(output), device=device))
            if prompt and p.repetition_penalty != 1.0:
                seen[i, torch.as_tensor(prompt, device=device)] = True
        return cls(*penalty_parameters(params, device), counts, seen)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Penalized logits (a new tensor). Repetition penalty (HF semantics) over prompt + output tokens: positive
        logits are divided by it, negative ones multiplied. Presence and frequency penalties (OpenAI semantics) over
        output tokens only: ``logit -= frequency * count + presence * (count > 0)``."""
        counts = self.output_counts
        seen = self.prompt_seen | (counts > 0)
        penalized = torch.where(logits > 0, logits / self.repetition, logits * self.repetition)
        logits = torch.where(seen, penalized, logits)
        return logits - self.frequency * counts - self.presence * (counts > 0).float()


def penalty_parameters(params: Sequence[SamplingParams], device: torch.device | str) -> tuple[torch.Tensor, ...]:
    """(repetition, presence, frequency), each ``[B, 1]``."""
    values = torch.tensor(
        [[p.repetition_penalty, p.presence_penalty, p.frequency_penalty] for p in params], dtype=torch.float32
    ).to(device)
    return values[:, 0:1], values[:, 1:2], values[:, 2:3]


@dataclass
class SamplingBatch:
    """The sampler's view of its rows, derived once per batch composition (host work O(rows))."""

    params: list[SamplingParams]
    generators: list[torch.Generator | None]
    device: torch.device
    greedy_only: bool = field(init=False)  # every row greedy and unpenalized: one argmax
    penalized_rows: list[int] = field(init=False)
    random_rows: torch.Tensor | None = field(init=False)  # rows that draw (temperature > 0)
    random_params: list[SamplingParams] = field(init=False)
    random_generators: list[torch.Generator | None] = field(init=False)
    temperature: torch.Tensor | None = field(init=False)  # [R, 1], of the random rows
    top_k: list[int] = field(init=False)
    top_p: torch.Tensor | None = field(init=False)
    min_p: torch.Tensor | None = field(init=False)
    logprob_rows: list[int] = field(init=False)
    num_top_logprobs: int = field(init=False)

    def __post_init__(self) -> None:
        params, dev = self.params, self.device
        self.penalized_rows = [i for i, p in enumerate(params) if has_penalties(p)]
        self.greedy_only = not self.penalized_rows and all(p.greedy for p in params)
        rows = [i for i, p in enumerate(params) if not p.greedy]
        sub = [params[i] for i in rows]
        self.random_params = sub
        self.random_generators = [self.generators[i] for i in rows]
        self.random_rows = torch.tensor(rows, device=dev) if rows and len(rows) < len(params) else None
        self.temperature = torch.tensor([p.temperature for p in sub], device=dev).unsqueeze(1) if sub else None
        self.top_k = [p.top_k for p in sub]
        self.top_p = torch.tensor([p.top_p for p in sub], device=dev) if any(p.top_p < 1 for p in sub) else None
        self.min_p = torch.tensor([p.min_p for p in sub], device=dev) if any(p.min_p > 0 for p in sub) else None
        self.logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        self.num_top_logprobs = max((params[i].logprobs or 0 for i in self.logprob_rows), default=0)


@dataclass
class SamplerOutput:
    """Sampled ids ``[B]`` and, for the rows that asked, raw logprobs; all on the logits' device."""

    token_ids: torch.Tensor
    logprob_rows: list[int]
    chosen_logprobs: torch.Tensor | None = None  # [L]
    top_ids: torch.Tensor | None = None  # [L, N]
    top_logprobs: torch.Tensor | None = None  # [L, N]
    emitted: list[list[int]] | None = None  # speculative decoding: every row's tokens, on the host (engine/spec/)
    drafts: list[list[int]] | None = None  # the MTP proposer's drafts for each row's next step, on the host

    def on_host(self, params: Sequence[SamplingParams]) -> tuple[np.ndarray, list[TokenLogprobs | None] | None]:
        """Call on host tensors: the ids (int64, one per row), and per row its `TokenLogprobs` (None if not asked)."""
        token_ids = self.token_ids.numpy()
        if not self.logprob_rows:
            return token_ids, None
        result: list[TokenLogprobs | None] = [None] * len(token_ids)
        chosen = self.chosen_logprobs.tolist()
        top_ids = self.top_ids.tolist() if self.top_ids is not None else [[] for _ in chosen]
        top_values = self.top_logprobs.tolist() if self.top_logprobs is not None else [[] for _ in chosen]
        for j, i in enumerate(self.logprob_rows):
            n = params[i].logprobs or 0
            # Tokens a grammar ruled out (-inf) are no alternatives; -inf is not valid JSON either.
            top = [(t, v) for t, v in zip(top_ids[j][:n], top_values[j][:n]) if v != float("-inf")]
            result[i] = TokenLogprobs(token_ids.item(i), chosen[j], top)
        return token_ids, result


def sample(logits: torch.Tensor, batch: SamplingBatch, penalties: Penalties | None = None) -> SamplerOutput:
    """Pick one token per row of ``logits`` ([B, V]) with each row's sampling parameters."""
    if logits.dim() != 2 or logits.shape[0] != len(batch.params):
        raise ValueError(f"logits must be [rows, vocab], got {tuple(logits.shape)} for {len(batch.params)} rows")
    logits = logits.float()
    raw = logits
    if batch.greedy_only:
        token_ids = logits.argmax(dim=-1)  # fast path: one argmax for the whole batch
    else:
        if penalties is not None:
            logits = penalties.apply(logits)
        token_ids = logits.argmax(dim=-1)
        if batch.random_params:
            index = batch.random_rows
            sub = logits if index is None else logits.index_select(0, index)
            drawn = _draw(sampling_probs(sub, batch), batch.random_generators)
            if index is None:
                token_ids = drawn
            else:
                token_ids[index] = drawn
    return _with_logprobs(raw, token_ids, batch)


def sampling_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p masks; returns the normalized distribution to draw from."""
    logits = logits / batch.temperature
    vocab = logits.shape[1]
    if all(0 < k < vocab for k in batch.top_k):
        # Every row keeps at most max(top_k) tokens: filter those candidates only, so top-p sorts a few values
        # instead of the whole vocabulary. (Ties at the largest k-th value beyond the candidates are cut here.)
        values, candidates = logits.topk(max(batch.top_k), dim=-1)
        filtered = torch.full_like(logits, float("-inf"))
        logits = filtered.scatter_(1, candidates, _apply_filters(values, batch))
    else:
        logits = _apply_filters(logits, batch)
    return logits.softmax(dim=-1)


def _apply_filters(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    if any(k > 0 for k in batch.top_k):
        logits = _apply_top_k(logits, batch.top_k)
    if batch.top_p is not None:
        logits = _apply_top_p(logits, batch.top_p)
    if batch.min_p is not None:
        logits = _apply_min_p(logits, batch.min_p)
    return logits


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


# Width of the blocks a draw races in (`draw_from`): one race among a row's block masses, then one within the block.
DRAW_BLOCK = 1024


def draw_noise_width(vocab: int) -> int:
    """Exp(1) variates one draw over a ``vocab``-token distribution takes: one per block, then one per token of a
    block."""
    return -(-vocab // DRAW_BLOCK) + min(vocab, DRAW_BLOCK)


def _draw(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One draw per row. Seeded rows fill their noise from their own generator; the rest share the default generator
    in one call."""
    noise = torch.empty(probs.shape[0], draw_noise_width(probs.shape[1]), device=probs.device)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if len(unseeded) == len(generators):
        noise.exponential_()
    elif unseeded:
        index = torch.tensor(unseeded, device=probs.device)
        noise[index] = torch.empty(len(unseeded), noise.shape[1], device=probs.device).exponential_()
    for i, generator in enumerate(generators):
        if generator is not None:
            noise[i].exponential_(generator=generator)
    return draw_from(probs, noise)


def draw_from(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Per row of ``probs`` ([R, V], non-negative, any total), a token drawn with probability proportional to its
    own, by the exponential race (argmax p / E with E ~ Exp(1) picks i with probability p_i) in two levels: among the
    row's masses in blocks of DRAW_BLOCK tokens, then among the chosen block's tokens. ``noise``: [R,
    draw_noise_width(V)] Exp(1) variates. Never a token of probability 0.

    One race over the whole vocabulary (vLLM's draw) needs an exponential variate per token: about 10 ms a row per
    step for a 152k vocabulary on a CPU core, most of a seeded batch's step time on the tiny models; two levels need
    ~1,200. (An inverse-transform draw needs one uniform, but its prefix sums carry the rounding of every earlier
    token: rows of the same request in different batch positions, whose logits differ in the last bits, then draw
    different tokens far more often.)
    """
    rows, vocab = probs.shape
    width = min(vocab, DRAW_BLOCK)
    blocks, full = -(-vocab // width), vocab // width * width
    masses = probs[:, :full].view(rows, vocab // width, width).sum(dim=-1)
    if full < vocab:
        masses = torch.cat([masses, probs[:, full:].sum(dim=-1, keepdim=True)], dim=1)
    # Exp(1) can round to exactly 0; a zero would turn a zero-probability block or token into 0/0 = nan.
    noise = noise.clamp(min=torch.finfo(noise.dtype).tiny)
    block = (masses / noise[:, :blocks]).argmax(dim=-1, keepdim=True)
    tokens = block * width + torch.arange(width, device=probs.device)
    inside = probs.gather(1, tokens.clamp(max=vocab - 1)).masked_fill(tokens >= vocab, 0.0)
    return (block * width + (inside / noise[:, blocks:]).argmax(dim=-1, keepdim=True)).squeeze(1)


def _with_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    rows = batch.logprob_rows
    if not rows:
        return SamplerOutput(token_ids, rows)
    index = torch.tensor(rows, device=logits.device)
    chosen, top_ids, top_values, _ = token_logprobs(logits.index_select(0, index), token_ids.index_select(0, index),
                                                    batch.num_top_logprobs)
    return SamplerOutput(token_ids, rows, chosen, top_ids, top_values)


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int, with_rank: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Under ``log_softmax(logits)``: each row's token's logprob [R]; the ids and logprobs of each row's `num_top`
    best [R, num_top] (None for 0); with `with_rank`, each token's rank [R] (1 + how many are more likely)."""
    logprobs = logits.float().log_softmax(dim=-1)
    chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    ranks = (logprobs > chosen.unsqueeze(1)).sum(dim=-1) + 1 if with_rank else None
    if not num_top:
        return chosen, None, None, ranks
    top = logprobs.topk(num_top, dim=-1)
    return chosen, top.indices, top.values, ranks
