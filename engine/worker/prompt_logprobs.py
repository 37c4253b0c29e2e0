"""Prompt logprobs (scoring, `SamplingParams.prompt_logprobs`): each prompt token's logprob under the model, computed
in the prefill that computes the prompt's K/V. The hidden state at position p predicts token p + 1, so a chunk of
positions [start, end) scores the prompt tokens start + 1 .. end (those that are prompt tokens).

The runner keeps a `PromptScoring` of the sequences with prompt tokens left to score; each step it asks for the
`PromptSpan`s of the scheduled chunks and, after the forward, `score_spans` turns those rows' hidden states into
logprobs, in slices of `SLICE_ROWS` rows so that a long prompt never holds [prompt, vocab] logits at once. Positions
must be computed to be scored: the scheduler never lets the prefix cache serve a position still to score (a cache
hit is capped there; see `Scheduler._admit_waiting`), and merges what a recompute after a preemption scores twice.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.outputs import SchedulerOutput, TokenLogprobs
from engine.worker.sampler import token_logprobs

SLICE_ROWS = 256


@dataclass
class PromptSpan:
    """Rows of one step's flattened batch that score prompt tokens of one sequence."""

    seq_id: str
    first_token: int  # the prompt index of the first token scored
    first_row: int  # the flattened row of the position that predicts it
    targets: np.ndarray  # the prompt tokens scored
    num_top: int


@dataclass
class ScoredSpan:
    """A span's logprobs, on the device (or copied to the host)."""

    seq_id: str
    first_token: int
    targets: np.ndarray  # the prompt tokens scored (host)
    chosen: torch.Tensor  # [n]
    ranks: torch.Tensor  # [n]
    top_ids: torch.Tensor | None  # [n, num_top]
    top_values: torch.Tensor | None

    def copied(self, copy: Callable[[torch.Tensor | None], torch.Tensor | None]) -> ScoredSpan:
        return ScoredSpan(self.seq_id, self.first_token, self.targets, copy(self.chosen), copy(self.ranks),
                          copy(self.top_ids), copy(self.top_values))

    def entries(self) -> list[TokenLogprobs]:
        """One `TokenLogprobs` per token scored (call on host tensors)."""
        chosen, ranks = self.chosen.tolist(), self.ranks.tolist()
        top_ids = self.top_ids.tolist() if self.top_ids is not None else [[] for _ in chosen]
        top_values = self.top_values.tolist() if self.top_values is not None else [[] for _ in chosen]
        return [TokenLogprobs(token, logprob, list(zip(ids, values)), rank)
                for token, logprob, rank, ids, values in zip(self.targets.tolist(), chosen, ranks, top_ids, top_values)]


class PromptScoring:
    """The runner's sequences whose prompt tokens are still to be scored: {seq id: (prompt ids, top alternatives)}."""

    def __init__(self) -> None:
        self._prompts: dict[str, tuple[np.ndarray, int]] = {}

    def __bool__(self) -> bool:
        return bool(self._prompts)

    def add(self, seq_id: str, prompt_token_ids: Sequence[int], num_top: int) -> None:
        if len(prompt_token_ids) > 1:
            self._prompts[seq_id] = (np.asarray(prompt_token_ids, dtype=np.int64), num_top)

    def discard(self, seq_id: str) -> None:
        self._prompts.pop(seq_id, None)

    def spans(self, sched: SchedulerOutput, row_of: Mapping[str, int], query_start_loc: np.ndarray) -> list[PromptSpan]:
        """The spans of this step's chunks; a sequence whose last prompt token is scored leaves the set."""
        spans = []
        for i, seq_id in enumerate(sched.seq_ids):
            found = self._prompts.get(seq_id)
            if found is None:
                continue
            prompt, num_top = found
            start = sched.num_computed_tokens[i]
            end = min(start + sched.num_new_tokens[i], len(prompt) - 1)  # the last prompt position predicts none
            if end > start:
                first_row = int(query_start_loc[row_of[seq_id]])
                spans.append(PromptSpan(seq_id, start + 1, first_row, prompt[start + 1 : end + 1], num_top))
            if end == len(prompt) - 1:
                del self._prompts[seq_id]
        return spans


def score_spans(hidden: torch.Tensor, spans: list[PromptSpan],
                compute_logits: Callable[[torch.Tensor], torch.Tensor | None]) -> list[ScoredSpan]:
    """The spans' logprobs from the step's hidden states ([tokens, hidden]). `compute_logits` returns None on the
    tensor-parallel ranks that do not sample: they take part in each slice's gather and score nothing."""
    scored = []
    for span in spans:
        targets = torch.from_numpy(span.targets).to(hidden.device)
        parts = []
        for i in range(0, len(targets), SLICE_ROWS):
            rows = hidden[span.first_row + i : span.first_row + min(i + SLICE_ROWS, len(targets))]
            logits = compute_logits(rows)
            if logits is not None:
                parts.append(token_logprobs(logits, targets[i : i + SLICE_ROWS], span.num_top, with_rank=True))
        if parts:
            chosen, top_ids, top_values, ranks = (None if p[0] is None else torch.cat(p) for p in zip(*parts))
            scored.append(ScoredSpan(span.seq_id, span.first_token, span.targets, chosen, ranks, top_ids, top_values))
    return scored
