"""The acceptance rules: greedy equality, and rejection sampling that keeps the target distribution (chi-square)."""
import pytest
import torch
from scipy.stats import chisquare

from engine.spec.acceptance import accept_greedy, rejection_sample
from engine.worker.sampler import draw_noise_width

# The chi-square tests below pass when the p-value is above this; with fixed seeds they are deterministic, and a
# rule that is off by a few percent in any cell lands far below it (see the negative control).
P_VALUE_THRESHOLD = 1e-3


def test_greedy_emits_the_target_chain_up_to_the_first_disagreement():
    drafts = torch.tensor([[5, 6, 7], [5, 6, 7], [1, 2, 3], [4, 4, 4]])
    num_drafts = torch.tensor([3, 3, 2, 0])
    target = torch.tensor([[5, 6, 7, 8], [5, 9, 7, 8], [1, 2, 0, 0], [3, 1, 1, 1]])
    result = accept_greedy(drafts, num_drafts, target)
    assert result.num_accepted.tolist() == [3, 1, 2, 0]
    emitted = [row[:n].tolist() for row, n in zip(result.token_ids, result.num_emitted)]
    assert emitted == [[5, 6, 7, 8], [5, 9], [1, 2, 0], [3]]


def toy_model(vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """p(t0) [V] and p(t1 | t0) [V, V]: a peaked, uneven target, so acceptance is neither certain nor rare."""
    g = torch.Generator().manual_seed(seed)
    first = (torch.randn(vocab, generator=g) * 1.5).softmax(0)
    second = (torch.randn(vocab, vocab, generator=g) * 1.5).softmax(1)
    return first, second


def sample_two_tokens(first, second, drafts, draft_probs, trials, seed):
    """Run the rule on `trials` independent rows with 2 drafts each; return the emitted (t0, t1) pairs."""
    g = torch.Generator().manual_seed(seed)
    vocab = first.shape[0]
    # Position 1's target distribution is conditioned on the first draft, as the target model's would be.
    target = torch.stack([first.expand(trials, vocab), second[drafts[:, 0]]], dim=1)
    target = torch.cat([target, second[drafts[:, 1]].unsqueeze(1)], dim=1)  # bonus position (not used by pairs)
    uniforms = torch.rand(trials, 2, generator=g)
    noise = torch.empty(trials, draw_noise_width(vocab)).exponential_(generator=g)
    result = rejection_sample(drafts, torch.full((trials,), 2), target, uniforms, noise, draft_probs)
    t0 = result.token_ids[:, 0]
    # Rows that emitted one token draw t1 in the next step from p(. | t0): do that here to observe the pair.
    t1 = torch.where(result.num_emitted >= 2, result.token_ids[:, 1],
                     torch.multinomial(second[t0], 1, generator=g).squeeze(1))
    return t0, t1


def pair_p_value(first, second, t0, t1):
    vocab = first.shape[0]
    observed = torch.bincount(t0 * vocab + t1, minlength=vocab * vocab).double()
    expected = (first.unsqueeze(1) * second).flatten().double() * len(t0)
    keep = expected >= 5  # chi-square's usual validity rule; the rare cells are pooled into one
    obs = torch.cat([observed[keep], observed[~keep].sum().view(1)])
    exp = torch.cat([expected[keep], expected[~keep].sum().view(1)])
    return chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue


@pytest.mark.parametrize("proposer", ["deterministic", "sampled"])
def test_rejection_sampling_keeps_the_target_distribution(proposer):
    """Chi-square over the joint distribution of the first two emitted tokens, 40,000 trials, 6-token vocabulary."""
    vocab, trials = 6, 40_000
    first, second = toy_model(vocab, seed=0)
    g = torch.Generator().manual_seed(1)
    if proposer == "deterministic":  # a model-free proposer, q one-hot: exact for every draft, so mix them
        drafts, draft_probs = torch.randint(vocab, (trials, 2), generator=g), None
        drafts[: trials // 2, 0] = 0  # the likeliest first token, so the second draft is judged often too
    else:  # a draft model: its own (different) distribution, drafts drawn from it
        q = (torch.randn(2, vocab, generator=g)).softmax(1)
        draft_probs = q.unsqueeze(0).expand(trials, 2, vocab).contiguous()
        drafts = torch.stack([torch.multinomial(q[i], trials, replacement=True, generator=g) for i in range(2)], 1)
    t0, t1 = sample_two_tokens(first, second, drafts, draft_probs, trials, seed=2)
    assert pair_p_value(first, second, t0, t1) > P_VALUE_THRESHOLD


def test_chi_square_catches_a_biased_rule():
    """Negative control: accepting a draft whenever p(x) > 0 (a common bug) fails the same test."""
    vocab, trials = 6, 40_000
    first, second = toy_model(vocab, seed=0)
    drafts = torch.tensor([[2, 4]]).expand(trials, 2).contiguous()
    g = torch.Generator().manual_seed(3)
    target = torch.stack([first.expand(trials, vocab), second[drafts[:, 0]], second[drafts[:, 1]]], 1)
    biased = rejection_sample(drafts, torch.full((trials,), 2), target, torch.zeros(trials, 2),
                              torch.empty(trials, draw_noise_width(vocab)).exponential_(generator=g))
    t0 = biased.token_ids[:, 0]
    t1 = biased.token_ids[:, 1]
    assert pair_p_value(first, second, t0, t1) < 1e-12


def test_rejection_sampling_handles_certain_and_padded_rows():
    vocab = 4
    certain = torch.zeros(2, 3, vocab)
    certain[:, :, 1] = 1.0  # the target puts all mass on token 1
    drafts = torch.tensor([[1, 1], [3, 1]])
    result = rejection_sample(drafts, torch.tensor([2, 1]), certain, torch.full((2, 2), 0.999),
                              torch.ones(2, draw_noise_width(vocab)))
    assert result.num_accepted.tolist() == [2, 0]
    assert result.token_ids[0].tolist() == [1, 1, 1] and result.token_ids[1, 0].item() == 1  # never token 3
    empty = rejection_sample(torch.zeros(1, 0, dtype=torch.long), torch.tensor([0]), certain[:1, :1],
                             torch.zeros(1, 0), torch.ones(1, draw_noise_width(vocab)))
    assert empty.token_ids.tolist() == [[1]]
