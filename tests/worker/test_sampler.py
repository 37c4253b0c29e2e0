from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.worker import sampler
from engine.outputs import TokenLogprobs
from engine.worker.sampler import Penalties, SamplingBatch, has_penalties, make_generator
from engine.sampling_params import SamplingParams


@dataclass
class Row:
    params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None


@dataclass
class Sampled:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def penalties(logits: torch.Tensor, rows: list[Row]) -> Penalties:
    return Penalties.from_histories([r.params for r in rows], [r.prompt_token_ids for r in rows],
                                    [r.output_token_ids for r in rows], logits.shape[1], logits.device)


def sample(logits: torch.Tensor, rows: list[Row]) -> Sampled:
    """The sampler as the runner drives it: a batch built from the rows, penalties from their histories."""
    params = [r.params for r in rows]
    batch = SamplingBatch(params, [r.generator for r in rows], logits.device)
    penalized = any(has_penalties(p) for p in params) and len(rows) == logits.shape[0]
    out = sampler.sample(logits, batch, penalties(logits, rows) if penalized else None)
    token_ids, logprobs = out.on_host(params)
    return Sampled(token_ids.tolist(), logprobs or [None] * len(rows))


def apply_penalties(logits: torch.Tensor, rows: list[Row]) -> torch.Tensor:
    return penalties(logits, rows).apply(logits)


def seeded(params: SamplingParams, prompt: list[int] | None = None) -> Row:
    assert params.seed is not None
    return Row(params, prompt or [], [], make_generator(params.seed, "cpu"))


def test_greedy_is_argmax_on_the_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(0))

    def no_draw(*args: object) -> None:
        raise AssertionError("an all-greedy batch without penalties must not draw")

    monkeypatch.setattr(sampler, "_draw", no_draw)
    assert SamplingBatch([SamplingParams(temperature=0)] * 6, [None] * 6, logits.device).greedy_only
    out = sample(logits, [Row(SamplingParams(temperature=0)) for _ in range(6)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 6


def test_greedy_rows_stay_argmax_in_a_mixed_batch() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    rows = [Row(SamplingParams(temperature=0)), Row(SamplingParams(temperature=1.5)),
            Row(SamplingParams(temperature=0)), Row(SamplingParams(temperature=0.8, top_k=5))]
    out = sample(logits, rows)
    assert out.token_ids[0] == int(logits[0].argmax())
    assert out.token_ids[2] == int(logits[2].argmax())


def _run_seeded(logits_steps: list[torch.Tensor], target: SamplingParams, others: list[Row], position: int) -> list[int]:
    """Decode len(logits_steps) steps of one seeded row placed at `position` among `others`."""
    row = seeded(target)
    tokens = []
    for step_logits in logits_steps:
        batch = others[:position] + [row] + others[position:]
        noise = torch.randn(len(batch), step_logits.shape[0])
        noise[position] = step_logits  # other rows see unrelated logits
        token = sample(noise, batch).token_ids[position]
        row.output_token_ids.append(token)
        tokens.append(token)
    return tokens


@pytest.mark.parametrize(
    "target",
    [
        SamplingParams(temperature=1.0, top_p=0.95, seed=1234),
        # alone, every row has top-k (the candidate-only path); in the crowd, not: both paths must agree
        SamplingParams(temperature=1.2, top_k=12, top_p=0.9, min_p=0.02, seed=77),
    ],
)
def test_same_seed_same_tokens_across_runs_and_batch_compositions(target: SamplingParams) -> None:
    gen = torch.Generator().manual_seed(2)
    steps = [torch.randn(64, generator=gen) for _ in range(30)]
    alone = _run_seeded(steps, target, [], 0)
    assert alone == _run_seeded(steps, target, [], 0)
    crowd = [Row(SamplingParams(temperature=0.9)), Row(SamplingParams(temperature=0)),
             seeded(SamplingParams(temperature=1.3, top_k=7, seed=99)), Row(SamplingParams(temperature=2.0))]
    assert alone == _run_seeded(steps, target, crowd, 2)
    assert alone == _run_seeded(steps, target, crowd[:1], 1)
    assert len(set(alone)) > 5  # the draws really are random, not a degenerate argmax


def test_different_seeds_give_different_tokens() -> None:
    logits = torch.zeros(1, 32)  # uniform: two independent streams agree on ~1/32 of draws
    streams = []
    for seed in (1, 2):
        row = seeded(SamplingParams(temperature=1.0, seed=seed))
        streams.append([sample(logits, [row]).token_ids[0] for _ in range(400)])
    agreement = sum(a == b for a, b in zip(*streams)) / 400
    assert agreement < 0.1
    assert len(set(streams[0])) == 32


def _allowed(logits: torch.Tensor, p: SamplingParams) -> set[int]:
    """Reference allowed set, in float64, with a hair of slack for float32 rounding in the sampler."""
    z = (logits / p.temperature).double()
    keep = torch.ones_like(z, dtype=torch.bool)
    if p.top_k > 0:
        kth = z.topk(min(p.top_k, z.numel())).values[-1]
        keep &= z >= kth
    probs = z.masked_fill(~keep, float("-inf")).softmax(-1)
    if p.top_p < 1:
        ordered = probs.sort(descending=True).values
        reaching = (ordered.cumsum(-1) >= p.top_p + 1e-5).nonzero()
        last = int(reaching[0]) if len(reaching) else len(ordered) - 1
        keep &= probs >= ordered[last] * (1 - 1e-5)
    if p.min_p > 0:
        keep &= probs >= p.min_p * probs.max() * (1 - 1e-5)
    return set(keep.nonzero().flatten().tolist())


@settings(max_examples=150, deadline=None)
@given(
    values=st.lists(st.one_of(st.floats(-8, 8, width=32), st.sampled_from([0.0, 1.0, 2.5])), min_size=2, max_size=48),
    temperature=st.floats(0.05, 3.0),
    top_k=st.sampled_from([0, -1, 1, 2, 3, 10, 100]),
    top_p=st.one_of(st.just(1.0), st.floats(0.01, 1.0)),
    min_p=st.one_of(st.just(0.0), st.floats(0.0, 1.0)),
)
@pytest.mark.slow
def test_filters_never_pick_outside_their_set(
    values: list[float], temperature: float, top_k: int, top_p: float, min_p: float
) -> None:
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    logits = torch.tensor(values, dtype=torch.float32)
    draws = 200
    torch.manual_seed(len(values))
    picked = set(sample(logits.expand(draws, -1).clone(), [Row(params)] * draws).token_ids)
    assert picked <= _allowed(logits, params)


def test_filters_with_known_sets() -> None:
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.06, 0.04]))
    draws = 2000
    cases = [
        (SamplingParams(top_k=2), {0, 1}),
        (SamplingParams(top_p=0.69), {0, 1}),  # 0.4 + 0.3 reaches 0.69
        (SamplingParams(top_p=0.71), {0, 1, 2}),
        (SamplingParams(top_p=0.01), {0}),  # always at least one token
        (SamplingParams(min_p=0.4), {0, 1, 2}),  # 0.06 < 0.4 * 0.4
        (SamplingParams(top_k=4, min_p=0.12), {0, 1, 2, 3}),  # 0.06 / 0.4 = 0.15 >= 0.12
        (SamplingParams(top_k=4, min_p=0.2), {0, 1, 2}),
    ]
    torch.manual_seed(0)
    for params, expected in cases:
        picked = set(sample(logits.expand(draws, -1).clone(), [Row(params)] * draws).token_ids)
        assert picked == expected, params


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_temperature_sampling_matches_softmax_over_temperature() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    temperature = 0.6
    draws = 20000
    torch.manual_seed(3)
    tokens = torch.tensor(sample(logits.expand(draws, -1).clone(), [Row(SamplingParams(temperature=temperature))] * draws).token_ids)
    counts = torch.bincount(tokens, minlength=8).double()
    critical = 24.32  # chi-square, 7 degrees of freedom, p = 0.001
    assert _chi_square(counts, (logits / temperature).double().softmax(-1)) < critical
    # the same counts are far from the untempered distribution, so the test can tell temperatures apart
    assert _chi_square(counts, logits.double().softmax(-1)) > 10 * critical


def test_seeded_draws_follow_the_distribution() -> None:
    logits = torch.tensor([[1.0, 0.0, -1.0, 0.5]])
    row = seeded(SamplingParams(temperature=1.0, seed=7))
    tokens = torch.tensor([sample(logits, [row]).token_ids[0] for _ in range(3000)])
    counts = torch.bincount(tokens, minlength=4).double()
    assert _chi_square(counts, logits[0].double().softmax(-1)) < 16.27  # 3 dof, p = 0.001


def test_penalties_follow_their_formulas() -> None:
    vocab = 10
    logits = torch.tensor([[1.5, -2.0, 0.5, 3.0, -0.25, 0.0, 2.0, -1.0, 4.0, 0.75]] * 2)
    rows = [
        Row(SamplingParams(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.25),
            prompt_token_ids=[0, 1, 1, 5], output_token_ids=[3, 3, 3, 4, 0]),
        Row(SamplingParams(), prompt_token_ids=[2, 6], output_token_ids=[8]),
    ]
    got = apply_penalties(logits, rows)
    expected = logits[0].tolist()
    for t in {0, 1, 5, 3, 4}:  # repetition: prompt + output, divide positive / multiply negative
        expected[t] = expected[t] / 1.3 if expected[t] > 0 else expected[t] * 1.3
    for t in range(vocab):  # presence / frequency: output only
        count = rows[0].output_token_ids.count(t)
        expected[t] -= 0.25 * count + (0.4 if count else 0.0)
    torch.testing.assert_close(got[0], torch.tensor(expected))
    torch.testing.assert_close(got[1], logits[1])  # neutral parameters leave the row untouched


def test_penalties_steer_greedy_choice() -> None:
    logits = torch.tensor([[5.0, 4.5, 0.0]])
    plain = Row(SamplingParams(temperature=0), output_token_ids=[0, 0])
    penalized = Row(SamplingParams(temperature=0, frequency_penalty=0.5), output_token_ids=[0, 0])
    assert sample(logits, [plain]).token_ids == [0]
    assert sample(logits, [penalized]).token_ids == [1]  # 5.0 - 2 * 0.5 = 4.0 < 4.5


def test_logprobs_are_raw_log_softmax_with_sorted_top() -> None:
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(5))
    rows = [
        Row(SamplingParams(temperature=0.7, repetition_penalty=1.5, logprobs=5), prompt_token_ids=[1, 2, 3]),
        Row(SamplingParams(temperature=0)),
        Row(SamplingParams(temperature=0, logprobs=0)),
    ]
    out = sample(logits, rows)
    raw = logits.log_softmax(-1)
    first = out.logprobs[0]
    assert first is not None and first.token_id == out.token_ids[0]
    assert math.isclose(first.logprob, float(raw[0, first.token_id]), abs_tol=1e-6)
    assert len(first.top) == 5
    assert [v for _, v in first.top] == sorted((v for _, v in first.top), reverse=True)
    assert [t for t, _ in first.top] == raw[0].topk(5).indices.tolist()
    for token, value in first.top:
        assert math.isclose(value, float(raw[0, token]), abs_tol=1e-6)
    assert out.logprobs[1] is None
    last = out.logprobs[2]
    assert last is not None and last.top == [] and last.token_id == int(logits[2].argmax())
    assert math.isclose(last.logprob, float(raw[2].max()), abs_tol=1e-6)


def test_rejects_mismatched_shapes() -> None:
    with pytest.raises(ValueError):
        sample(torch.zeros(2, 5), [Row(SamplingParams())])
