"""How far a variant of a model (FP8 weights, FP8 KV pages) drifts from the original, measured through the engine.

Teacher forcing: the original's greedy continuation of each prompt is fed back one token at a time, so both models
are scored on the same contexts even after their own greedy choices would diverge. At every position both return
their top-20 logprobs; the drift compares the logprobs of the tokens both lists contain, and counts how often the
variant keeps the original's greedy token first.

Tiny random models have a flat top over a 150k vocabulary (their top five logprobs often lie within 0.1 nats of
each other), so a small perturbation reorders the top; the logprob distance is the stable measure.
"""
from __future__ import annotations

from dataclasses import dataclass
from statistics import mean

from engine import LLM, SamplingParams


@dataclass(frozen=True)
class Drift:
    positions: int
    argmax_agreement: float  # fraction of positions where both pick the same greedy token
    max_abs: float  # over every token in both top-20 lists, at every position
    mean_abs: float


def logprob_drift(original: LLM, variant: LLM, prompts: list[list[int]], new_tokens: int) -> Drift:
    greedy = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    continuations = [out.token_ids for out in original.generate(prompts, greedy)]
    contexts = [prompt + cont[:i] for prompt, cont in zip(prompts, continuations) for i in range(new_tokens)]
    scored = SamplingParams(max_tokens=1, temperature=0, logprobs=20)
    agree, diffs = 0, []
    for ref, got in zip(original.generate(contexts, scored), variant.generate(contexts, scored)):
        ref_lp, got_lp = ref.outputs[0].logprobs[0], got.outputs[0].logprobs[0]
        agree += ref_lp.token_id == got_lp.token_id
        got_top = dict(got_lp.top)
        diffs += [abs(lp - got_top[token]) for token, lp in ref_lp.top if token in got_top]
    return Drift(len(contexts), agree / len(contexts), max(diffs), mean(diffs))
