"""MLA's paged pieces: the absorbed decode reference against a per-sequence oracle, the Triton decode kernel against
the reference (direct and split-K), and store_kv writing a latent and a rotary key into one page tensor."""
from __future__ import annotations

import pytest
import torch

from tests.kernels.test_triton_ops import ATTENTION_TOL, DEVICE, TRITON, assert_close  # sets TRITON_INTERPRET first
from kernels import reference  # noqa: I001 - after the interpreter switch


def latent_batch(context_lens: list[int], num_heads: int, latent: int, rope: int, block_size: int,
                 dtype: torch.dtype, seed: int = 0) -> tuple:
    """Shuffled pages; every slot outside a context (and the page block-table padding points at) holds NaN."""
    gen = torch.Generator().manual_seed(seed)
    pages_per_seq = [-(-c // block_size) for c in context_lens]
    num_pages = sum(pages_per_seq) + 2
    cache = torch.full((num_pages, block_size, 1, latent + rope), float("nan"))
    order = torch.randperm(num_pages, generator=gen).tolist()
    nan_page = order.pop()
    tables = torch.full((len(context_lens), max(pages_per_seq) + 1), nan_page, dtype=torch.int32)
    for b, (ctx, n_pages) in enumerate(zip(context_lens, pages_per_seq)):
        pages = [order.pop() for _ in range(n_pages)]
        tables[b, :n_pages] = torch.tensor(pages, dtype=torch.int32)
        for pos in range(ctx):
            cache[pages[pos // block_size], pos % block_size, 0] = torch.randn(latent + rope, generator=gen)
    query = torch.randn(len(context_lens), num_heads, latent + rope, generator=gen)
    scale = (latent + rope) ** -0.5
    return (query.to(DEVICE, dtype), cache.to(DEVICE, dtype), tables.to(DEVICE),
            torch.tensor(context_lens, dtype=torch.int32, device=DEVICE), scale, latent)


def per_sequence_oracle(query, cache, tables, context_lens, scale, latent) -> torch.Tensor:
    out = []
    block_size = cache.shape[1]
    for b, ctx in enumerate(context_lens.tolist()):
        rows = torch.stack([cache[int(tables[b, p // block_size]), p % block_size, 0] for p in range(ctx)]).double()
        probs = torch.softmax(query[b].double() @ rows.T * scale, dim=-1)
        out.append(probs @ rows[:, :latent])
    return torch.stack(out)


CONTEXTS = [1, 5, 17, 33, 70]  # a one-token context, page boundaries, several key tiles


def test_reference_matches_per_sequence_oracle() -> None:
    batch = latent_batch(CONTEXTS, 3, 32, 16, 4, torch.float32)
    expected = per_sequence_oracle(*(t.cpu() if isinstance(t, torch.Tensor) else t for t in batch))
    torch.testing.assert_close(reference.mla_decode(*batch).cpu().double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_heads", [4, 16, 20])  # fewer heads than a tile, one tile, a ragged second tile
@pytest.mark.parametrize("split_k", [False, True])
@pytest.mark.fast_cases("False-4")
def test_mla_decode_matches_reference_fp32(num_heads: int, split_k: bool) -> None:
    batch = latent_batch(CONTEXTS, num_heads, 32, 16, 4, torch.float32, seed=num_heads)
    out = TRITON.mla_decode(*batch, split_k=split_k, partition_size=32)
    assert_close(out, reference.mla_decode(*batch), ATTENTION_TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.fast_cases("dtype0")
def test_mla_decode_matches_reference_half(dtype: torch.dtype) -> None:
    batch = latent_batch([3, 40], 8, 32, 16, 16, dtype, seed=7)
    expected = reference.mla_decode(*batch)
    assert_close(TRITON.mla_decode(*batch, split_k=False), expected, ATTENTION_TOL[dtype])
    assert_close(TRITON.mla_decode(*batch, split_k=True, partition_size=32, max_context_len=64), expected,
                 ATTENTION_TOL[dtype])


def test_mla_split_k_partitions_stay_bounded_at_long_contexts(monkeypatch: pytest.MonkeyPatch) -> None:
    from kernels.triton.mla import MAX_PARTITIONS, mla_partition_size

    cpu = torch.device("cpu")
    monkeypatch.setattr("kernels.triton.attention.num_compute_units", lambda device: 132)  # an H200's SMs
    assert mla_partition_size(1, 8, 1100, cpu) == 64  # short contexts: the attention kernel's choice
    assert mla_partition_size(1, 8, 4096, cpu) == 128
    for context in (65536, 163840):  # where the attention kernel's 512 would make 128 and 320 partitions
        size = mla_partition_size(1, 8, context, cpu)
        assert -(-context // size) <= MAX_PARTITIONS and size & (size - 1) == 0
    batch = latent_batch([70, 9], 4, 32, 16, 4, torch.float32, seed=5)  # the heuristic's own choice, run
    assert_close(TRITON.mla_decode(*batch, split_k=True), reference.mla_decode(*batch), 1e-5)


def test_mla_decode_real_latent_width() -> None:
    """DeepSeek-V3's row: a 512-value latent and a 64-value rotary key (one 576-value head per token)."""
    batch = latent_batch([2, 19], 16, 512, 64, 16, torch.float32, seed=3)
    assert_close(TRITON.mla_decode(*batch), reference.mla_decode(*batch), ATTENTION_TOL[torch.float32])


def test_mla_decode_empty_batch() -> None:
    query, cache, tables, lens, scale, latent = latent_batch([3], 4, 32, 16, 4, torch.float32)
    assert TRITON.mla_decode(query[:0], cache, tables[:0], lens[:0], scale, latent).shape == (0, 4, 32)


@pytest.mark.parametrize("ops", [reference, TRITON], ids=["reference", "triton"])
@pytest.mark.fast_cases("reference")
def test_store_kv_writes_latent_and_rope_key_into_one_page(ops) -> None:
    latent, rope, block_size = 32, 16, 4
    cache = torch.zeros(3, block_size, 1, latent + rope, device=DEVICE)
    kv = torch.randn(5, latent + rope + 8, device=DEVICE)  # strided views of a wider projection, as MLA has them
    slots = torch.tensor([6, 0, -1, 11, 3], device=DEVICE)
    ops.store_kv(kv[:, None, :latent], kv[:, None, latent:latent + rope], cache[..., :latent], cache[..., latent:],
                 slots)
    flat = cache.view(-1, latent + rope)
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(flat[slot], kv[row, :latent + rope])
    assert int((flat.abs().sum(-1) > 0).sum()) == 4  # the padding row wrote nothing
