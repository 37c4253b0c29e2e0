"""DeepSeek Sparse Attention ops: the lightning indexer's top-k and the sparse absorbed MLA, the references against
brute-force oracles and the Triton kernels (under the interpreter on CPU) against the references, on a flattened
batch mixing prefill chunks after cached prefixes with decode rows, pages shuffled, NaN outside every context."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tests.kernels.test_triton_ops import ATTENTION_TOL, DEVICE, TRITON, assert_close  # sets TRITON_INTERPRET first
from kernels import reference
from kernels.reference import sparse as reference_sparse  # noqa: I001 - after the interpreter switch

BLOCK = 4
# (context length, new query rows): decodes, a whole prompt, chunks after a cached prefix, contexts over topk
SEQS = [(1, 1), (9, 9), (23, 5), (40, 1), (70, 3)]


@dataclass
class Batch:
    query_start_loc: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_of: list[list[int]]  # per sequence, the slot of each context position

    @property
    def num_rows(self) -> int:
        return int(self.query_start_loc[-1])

    def paged(self, rows: list[torch.Tensor], width: int, dtype: torch.dtype) -> torch.Tensor:
        """Pages ``[N, BLOCK, 1, width]`` holding ``rows[b][pos]`` at each sequence's slots, NaN elsewhere."""
        num_pages = int(self.block_tables.max()) + 2
        cache = torch.full((num_pages * BLOCK, width), float("nan"))
        for b, values in enumerate(rows):
            cache[self.slot_of[b]] = values
        return cache.view(num_pages, BLOCK, 1, width).to(DEVICE, dtype)

    def rows(self) -> list[tuple[int, int, int]]:
        """``(row, sequence, position)`` of every query row."""
        out = []
        for b, (ctx, q_len) in enumerate(SEQS):
            start = int(self.query_start_loc[b])
            out += [(start + i, b, ctx - q_len + i) for i in range(q_len)]
        return out


def make_batch(seed: int = 0) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    pages_per_seq = [-(-ctx // BLOCK) for ctx, _ in SEQS]
    order = torch.randperm(sum(pages_per_seq) + 1, generator=gen).tolist()
    tables = torch.full((len(SEQS), max(pages_per_seq) + 1), order.pop(), dtype=torch.int32)  # padding: a NaN page
    slot_of = []
    for b, ((ctx, _), n) in enumerate(zip(SEQS, pages_per_seq)):
        pages = [order.pop() for _ in range(n)]
        tables[b, :n] = torch.tensor(pages, dtype=torch.int32)
        slot_of.append([pages[p // BLOCK] * BLOCK + p % BLOCK for p in range(ctx)])
    starts = torch.tensor([0] + [q for _, q in SEQS]).cumsum(0).to(torch.int32)
    lens = torch.tensor([c for c, _ in SEQS], dtype=torch.int32)
    return Batch(starts.to(DEVICE), lens.to(DEVICE), tables.to(DEVICE), slot_of)


def indexer_inputs(batch: Batch, heads: int, dim: int, dtype: torch.dtype, seed: int = 0,
                   signed: bool = False) -> tuple:
    """Unsigned head weights by default: then only tokens whose every head is cut by the ReLU score 0 and tie, and
    they come last, so two implementations choose the same tokens."""
    gen = torch.Generator().manual_seed(seed)
    keys = [torch.randn(ctx, dim, generator=gen) for ctx, _ in SEQS]
    query = torch.randn(batch.num_rows, heads, dim, generator=gen).to(DEVICE, dtype)
    weights = torch.randn(batch.num_rows, heads, generator=gen) if signed else torch.rand(batch.num_rows, heads,
                                                                                           generator=gen) + 0.1
    weights = weights.to(DEVICE)
    return query, weights, batch.paged(keys, dim, dtype), keys


def _index_args(batch: Batch, query, weights, cache, topk: int) -> tuple:
    seq, pos = reference_sparse.query_rows(batch.query_start_loc, batch.context_lens, batch.num_rows)
    return query, weights, cache, batch.block_tables, seq, pos, query.shape[-1] ** -0.5, topk


@pytest.mark.parametrize("topk", [8, 16, 128])  # fewer than most contexts, a page multiple, more than any
@pytest.mark.fast_cases("8")
def test_reference_index_topk_is_the_best_scored_visible_tokens(topk: int) -> None:
    batch = make_batch()
    query, weights, cache, keys = indexer_inputs(batch, 5, 24, torch.float32, signed=True)
    slots = reference_sparse.index_topk(*_index_args(batch, query, weights, cache, topk)).cpu()
    for row, b, pos in batch.rows():
        visible = keys[b][: pos + 1].double()
        per_head = torch.relu(query[row].cpu().double() @ visible.T * 24**-0.5)
        scores = weights[row].cpu().double() @ per_head
        position_of = {slot: p for p, slot in enumerate(batch.slot_of[b])}
        chosen = [position_of[s] for s in slots[row].tolist() if s >= 0]
        assert len(set(chosen)) == len(chosen) == min(topk, pos + 1)
        # best first; compared by score, since tokens whose every head is cut by the ReLU tie at 0
        assert scores[chosen].tolist() == scores.topk(len(chosen)).values.tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [4, 16, 20])
@pytest.mark.fast_cases("4-dtype0")
def test_triton_index_topk_matches_reference(dtype: torch.dtype, heads: int) -> None:
    batch = make_batch(seed=heads)
    query, weights, cache, _ = indexer_inputs(batch, heads, 32, dtype, seed=heads)
    args = _index_args(batch, query, weights, cache, 16)
    expected = reference_sparse.index_topk(*args)
    got = TRITON.index_topk(*args, max_context_len=max(c for c, _ in SEQS))
    assert got.dtype == torch.int32 and got.shape == expected.shape
    # The same tokens, in the same order but where two scores tie within rounding.
    assert [sorted(r) for r in got.tolist()] == [sorted(r) for r in expected.tolist()]


def latent_inputs(batch: Batch, heads: int, latent: int, rope: int, topk: int, dtype: torch.dtype,
                  seed: int = 0) -> tuple:
    """Query rows, latent pages and, per row, ``topk`` random visible slots (fewer where fewer are visible)."""
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.randn(ctx, latent + rope, generator=gen) for ctx, _ in SEQS]
    query = torch.randn(batch.num_rows, heads, latent + rope, generator=gen).to(DEVICE, dtype)
    slots = torch.full((batch.num_rows, topk), -1, dtype=torch.int32)
    for row, b, pos in batch.rows():
        chosen = torch.randperm(pos + 1, generator=gen)[:topk].tolist()
        slots[row, : len(chosen)] = torch.tensor([batch.slot_of[b][p] for p in chosen], dtype=torch.int32)
    return query, batch.paged(rows, latent + rope, dtype), slots.to(DEVICE), (latent + rope) ** -0.5, latent


def test_reference_sparse_mla_matches_oracle() -> None:
    batch = make_batch()
    query, cache, slots, scale, latent = latent_inputs(batch, 3, 32, 16, 16, torch.float32)
    out = reference_sparse.sparse_mla(query, cache, slots, scale, latent)
    flat = cache.view(-1, cache.shape[-1]).double()
    for row in range(batch.num_rows):
        chosen = [s for s in slots[row].tolist() if s >= 0]
        keys = flat[chosen]
        probs = torch.softmax(query[row].double() @ keys.T * scale, dim=-1)
        torch.testing.assert_close(out[row].double(), probs @ keys[:, :latent], atol=1e-5, rtol=1e-5)


def test_sparse_mla_over_every_token_is_mla_decode() -> None:
    """A decode row whose slots are its whole context attends exactly as the dense absorbed decode."""
    batch = make_batch()
    query, cache, slots, scale, latent = latent_inputs(batch, 4, 32, 16, 128, torch.float32)
    decodes = [b for b, (_, q_len) in enumerate(SEQS) if q_len == 1]
    rows = batch.query_start_loc[decodes].long()
    dense = reference.mla_decode(query[rows], cache, batch.block_tables[decodes], batch.context_lens[decodes],
                                 scale, latent)
    assert_close(reference_sparse.sparse_mla(query[rows], cache, slots[rows], scale, latent), dense, 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [4, 16, 20])  # fewer heads than a tile, one tile, a ragged second tile
@pytest.mark.fast_cases("4-dtype0")
def test_triton_sparse_mla_matches_reference(dtype: torch.dtype, heads: int) -> None:
    batch = make_batch(seed=heads)
    args = latent_inputs(batch, heads, 32, 16, 40, dtype, seed=heads)  # several slot tiles, padded rows
    assert_close(TRITON.sparse_mla(*args), reference_sparse.sparse_mla(*args), ATTENTION_TOL[dtype])
