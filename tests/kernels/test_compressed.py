"""DeepSeek-V4's reference ops against direct formulas: gated window pooling whatever the step, chunk and block
boundaries (the pooling state carried in the pages, also through a prefix shared by another sequence), and
attention with sinks over gathered slots (and its Triton kernel, under the interpreter on CPU, against it)."""
from __future__ import annotations

import pytest
import torch

from tests.kernels.test_triton_ops import ATTENTION_TOL, DEVICE, TRITON, assert_close  # sets TRITON_INTERPRET first
from kernels.reference.compressed import pool_windows, pooling_state_size, sink_attention  # noqa: I001

BLOCK = 8
DIM = 6


def direct_entries(kv: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, rate: int, overlap: bool
                   ) -> torch.Tensor:
    """transformers' formula over a whole sequence: entry w pools window w's tokens (its Cb half with ``overlap``,
    beside window w-1's Ca half), softmax over the tokens per channel, in float64."""
    n = kv.shape[0] // rate
    kv, gate = kv[: n * rate].double().view(n, rate, -1), (gate[: n * rate].double().view(n, rate, -1) + bias.double())
    if not overlap:
        return (kv * gate.softmax(dim=1)).sum(dim=1)
    ca_kv = torch.cat([torch.zeros_like(kv[:1, :, :DIM]), kv[:-1, :, :DIM]])
    ca_gate = torch.cat([torch.full_like(gate[:1, :, :DIM], float("-inf")), gate[:-1, :, :DIM]])
    both_kv, both_gate = torch.cat([ca_kv, kv[..., DIM:]], dim=1), torch.cat([ca_gate, gate[..., DIM:]], dim=1)
    return (both_kv * both_gate.softmax(dim=1)).sum(dim=1)


def run_chunks(kv, gate, bias, rate, overlap, chunks: list[int], table: list[int], state: torch.Tensor,
               start: int = 0) -> dict[int, torch.Tensor]:
    """Feed positions ``start..`` in ``chunks`` (one sequence, pages ``table``); the entries closed, by window."""
    out, done = {}, start
    tables = torch.tensor([table], dtype=torch.int32)
    for n in chunks:
        rows = slice(done, done + n)
        pooled, seqs, windows = pool_windows(
            kv[rows], gate[rows], bias, state, tables, torch.tensor([done + n], dtype=torch.int32),
            torch.tensor([0, n], dtype=torch.int32), rate, overlap, BLOCK)
        assert seqs.tolist() == [0] * len(windows)
        out.update({w: p for w, p in zip(windows.tolist(), pooled)})
        done += n
    return out


@pytest.mark.parametrize("overlap,rate", [(False, 4), (False, 8), (True, 4)])
@pytest.mark.parametrize("chunks", [[37], [1] * 37, [5, 1, 1, 9, 3, 2, 16], [8, 8, 13, 8]])
@pytest.mark.fast_cases("chunks0-False-4")
def test_pooling_in_any_steps_equals_the_whole_window_formula(overlap: bool, rate: int, chunks: list[int]) -> None:
    gen = torch.Generator().manual_seed(rate + len(chunks))
    width = 2 * DIM if overlap else DIM
    kv, gate = torch.randn(37, width, generator=gen), 2 * torch.randn(37, width, generator=gen)
    bias = torch.randn(rate, width, generator=gen)
    state = torch.full((12, pooling_state_size(DIM, overlap)), float("nan"))  # never read before it is written
    got = run_chunks(kv, gate, bias, rate, overlap, chunks, [7, 2, 9, 4, 11], state)
    expected = direct_entries(kv, gate, bias, rate, overlap)
    assert sorted(got) == list(range(37 // rate))
    torch.testing.assert_close(torch.stack([got[w] for w in sorted(got)]).double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.fast_cases("False")
def test_a_sequence_resumes_from_the_state_in_a_shared_block(overlap: bool) -> None:
    """Sequence B shares A's first two blocks (a prefix-cache hit) and computes only what follows: its entries
    equal those of the whole sequence, read from the state A left at the end of the shared block."""
    gen = torch.Generator().manual_seed(3)
    width = 2 * DIM if overlap else DIM
    kv, gate = torch.randn(30, width, generator=gen), torch.randn(30, width, generator=gen)
    bias = torch.randn(4, width, generator=gen)
    state = torch.full((12, pooling_state_size(DIM, overlap)), float("nan"))
    run_chunks(kv, gate, bias, 4, overlap, [21], [5, 3, 8], state)  # A: blocks 5 and 3 full, 8 partial
    got = run_chunks(kv, gate, bias, 4, overlap, [3, 9], [5, 3, 10, 1], state, start=16)  # B after the hit
    expected = direct_entries(kv, gate, bias, 4, overlap)
    assert sorted(got) == [4, 5, 6]
    torch.testing.assert_close(torch.stack([got[w] for w in (4, 5, 6)]).double(), expected[4:], atol=1e-5, rtol=1e-5)


def test_sink_attention_matches_the_formula() -> None:
    gen = torch.Generator().manual_seed(0)
    heads, dim = 3, 8
    query = torch.randn(5, heads, dim, generator=gen)
    tokens, entries = torch.randn(20, dim, generator=gen), torch.randn(6, dim, generator=gen)
    window = torch.tensor([[0, 1, -1], [2, 3, 4], [5, -1, -1], [6, 7, 8], [9, 10, 11]])
    picked = torch.tensor([[-1, -1], [0, 5], [1, -1], [2, 3], [4, -1]])
    sinks = torch.randn(heads, generator=gen)
    out = sink_attention(query, [(tokens, window), (entries, picked)], sinks, dim**-0.5)
    for row in range(5):
        keys = torch.cat([tokens[[s for s in window[row].tolist() if s >= 0]],
                          entries[[s for s in picked[row].tolist() if s >= 0]]]).double()
        logits = query[row].double() @ keys.T * dim**-0.5
        probs = torch.cat([logits, sinks.double()[:, None]], dim=-1).softmax(dim=-1)[:, :-1]
        torch.testing.assert_close(out[row].double(), probs @ keys, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,dim,two_sources", [(4, 32, True), (16, 64, False), (20, 32, True)])
@pytest.mark.fast_cases("4-32-True-dtype0")
def test_triton_sink_attention_matches_reference(dtype: torch.dtype, heads: int, dim: int, two_sources: bool) -> None:
    """Rows with windows of 40 slots (several tiles, -1 where a row is younger than its window) and 6 picked
    entries (some rows none)."""
    gen = torch.Generator().manual_seed(heads)
    rows = 7
    query = torch.randn(rows, heads, dim, generator=gen).to(DEVICE, dtype)
    tokens = torch.randn(300, dim, generator=gen).to(DEVICE, dtype)
    window = torch.randint(0, 300, (rows, 40), generator=gen, dtype=torch.int32)
    window[:, :rows] = torch.where(torch.arange(rows)[:, None] > torch.arange(rows)[None, :], -1, window[:, :rows])
    sources = [(tokens, window.to(DEVICE))]
    if two_sources:
        entries = torch.randn(30, dim, generator=gen).to(DEVICE, dtype)
        picked = torch.randint(0, 30, (rows, 6), generator=gen, dtype=torch.int32)
        picked[::3] = -1
        sources.append((entries, picked.to(DEVICE)))
    sinks = torch.randn(heads, generator=gen).to(DEVICE)
    got = TRITON.sink_attention(query, sources, sinks, dim**-0.5)
    assert_close(got, sink_attention(query, sources, sinks, dim**-0.5), ATTENTION_TOL[dtype])
