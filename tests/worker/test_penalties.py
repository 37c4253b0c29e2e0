"""Repetition, presence and frequency penalties give transformers' greedy tokens on the same weights, in a batch whose
composition changes every few steps (sequences finish at different lengths, penalized rows beside unpenalized ones):
the runner keeps each sequence's output counts as a row of the batch's tensor and carries them across batches."""
from __future__ import annotations

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from engine import SamplingParams
from tests.hf_oracle import hf_model, random_prompts

LENGTHS = [3, 9, 17, 6, 12]


class _OpenAIPenalties(LogitsProcessor):
    """Presence and frequency penalties over the generated tokens (after transformers' repetition penalty, the
    engine's order too)."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        out = input_ids[:, self.prompt_len :]
        counts = torch.zeros_like(scores).scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def _hf_penalized(prompt: list[int], p: SamplingParams) -> list[int]:
    with torch.no_grad():
        out = hf_model("qwen3-tiny").generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=p.max_tokens, do_sample=False, pad_token_id=0, repetition_penalty=p.repetition_penalty,
            logits_processor=LogitsProcessorList([_OpenAIPenalties(len(prompt), p.presence_penalty,
                                                                   p.frequency_penalty)]))
    return out[0, len(prompt):].tolist()


def test_penalties_match_transformers_across_batch_changes(qwen3_llm):
    prompts = random_prompts(qwen3_llm.engine.model_cfg.vocab_size, LENGTHS, seed=7)
    params = [
        # below 1 and negative: the penalties favour tokens seen before, so greedy picks change on a random model
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, repetition_penalty=0.3),
        SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=0, ignore_eos=True, frequency_penalty=-1.5, presence_penalty=-0.5),
        SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, repetition_penalty=0.5, frequency_penalty=1.0),
        SamplingParams(max_tokens=14, temperature=0, ignore_eos=True, presence_penalty=-2.0),
    ]
    outs = qwen3_llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [_hf_penalized(prompt, p) for prompt, p in zip(prompts, params)]
    # The penalties change what greedy picks: the check above is not the unpenalized continuation.
    plain = qwen3_llm.generate(prompts, [SamplingParams(max_tokens=p.max_tokens, temperature=0, ignore_eos=True)
                                         for p in params])
    assert sum(o.token_ids != q.token_ids for o, q in zip(outs, plain)) >= 3
