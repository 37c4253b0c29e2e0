"""Sliding-window paged attention (``window``: a query at position p sees keys in ``(p - window, p]``), for every
op set: the pure-torch reference against a dense float64 oracle written from the definition, then the Triton kernel
(under the interpreter on CPU) and the native CPU decode kernel against the reference.

Batches cross block boundaries, mix prefill chunks after a cached prefix with decodes, use GQA groups and ragged
lengths, and windows of one token, smaller than a block, a block and a half, and larger than any context. Every slot
before the earliest window of a sequence holds NaN (as do slots past its context and table padding), so a kernel that
reads a key outside the window, even one it then masks, poisons its output.
"""
from __future__ import annotations

import pytest
import torch

from tests.kernels.test_triton_ops import ATTENTION_TOL, MIXED_CONTEXT, MIXED_QUERY, TRITON, assert_close, make_batch
from kernels.cpu import attention as cpu_attention
from kernels import reference  # noqa: I001 - after the interpreter switch (tests.kernels.test_triton_ops)
from kernels.ops import get_ops

CPU = get_ops("cpu")
WINDOWS = [1, 3, 4, 6, 13, 1000]  # one token, under a block of 4, a block, 1.5 blocks, several blocks, all


def poison_outside_windows(batch, window: int) -> None:
    """NaN into every slot of each sequence before the window of its first query row (positions no row may see)."""
    starts = batch.query_start_loc.tolist()
    block_size = batch.k_cache.shape[1]
    for b, ctx in enumerate(batch.context_lens.tolist()):
        q_len = starts[b + 1] - starts[b]
        first_visible = max(0, ctx - q_len - window + 1) if q_len else ctx
        for pos in range(first_visible):
            page, offset = int(batch.block_tables[b, pos // block_size]), pos % block_size
            batch.k_cache[page, offset] = float("nan")
            batch.v_cache[page, offset] = float("nan")


def dense_oracle(batch, window: int | None) -> torch.Tensor:
    """Attention written from the definition, in float64, one query row at a time."""
    out = torch.zeros(batch.query.shape, dtype=torch.float64)
    starts, lens = batch.query_start_loc.tolist(), batch.context_lens.tolist()
    block_size = batch.k_cache.shape[1]
    num_heads, num_kv_heads = batch.query.shape[1], batch.k_cache.shape[2]
    for b, ctx in enumerate(lens):
        q_len = starts[b + 1] - starts[b]
        for i in range(q_len):
            pos = ctx - q_len + i
            lo = 0 if window is None else max(0, pos - window + 1)
            keys = range(lo, pos + 1)
            slots = [(int(batch.block_tables[b, t // block_size]), t % block_size) for t in keys]
            k = torch.stack([batch.k_cache[p, o] for p, o in slots]).double().cpu()  # [n, Hkv, D]
            v = torch.stack([batch.v_cache[p, o] for p, o in slots]).double().cpu()
            q = batch.query[starts[b] + i].double().cpu()  # [Hq, D]
            for h in range(num_heads):
                kv = h // (num_heads // num_kv_heads)
                weights = torch.softmax(k[:, kv] @ q[h] * batch.scale, dim=0)
                out[starts[b] + i, h] = weights @ v[:, kv]
    return out.to(batch.query.dtype)


def windowed_batch(contexts, queries, window, group=2, head_dim=64, block_size=4, dtype=torch.float32, seed=0):
    batch = make_batch(contexts, queries, 2, group, head_dim, block_size, dtype, seed=seed)
    poison_outside_windows(batch, window)
    return batch


# ------------------------------------------------------------------------------------------------------ reference


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.fast_cases("4-1")
def test_reference_equals_the_definition(window: int, block_size: int) -> None:
    batch = windowed_batch(MIXED_CONTEXT, MIXED_QUERY, window, group=2, block_size=block_size, seed=window)
    got = reference.paged_attention(*batch.args(), window=window)
    assert not got.isnan().any()
    assert_close(got.cpu(), dense_oracle(batch, window), 1e-5)


def test_reference_without_a_window_is_unchanged_and_a_wide_window_is_no_window() -> None:
    batch = make_batch(MIXED_CONTEXT, MIXED_QUERY, 2, 2, 64, 4, torch.float32, seed=1)
    full = reference.paged_attention(*batch.args())
    assert_close(full.cpu(), dense_oracle(batch, None), 1e-5)
    assert torch.equal(reference.paged_attention(*batch.args(), window=max(MIXED_CONTEXT)), full)
    narrow = reference.paged_attention(*batch.args(), window=5)
    assert not torch.allclose(narrow, full), "the window changes what long contexts see"


def test_reference_decode_plan_serves_local_and_global_layers_of_one_step() -> None:
    """A step's plan is built once and shared by every layer; its padded gathers are kept per window size, so a
    local layer and the global layer after it each read their own (in either order, on the same tensors)."""
    batch = make_batch([23, 18, 9, 30, 5], [1] * 5, 2, 2, 64, 4, torch.float32, seed=5)
    for _ in range(2):
        for window in (None, 7, 3, None):
            got = reference.paged_attention(*batch.args(), window=window)
            assert_close(got.cpu(), dense_oracle(batch, window), 1e-5)


# ------------------------------------------------------------------------------------------------------- Triton


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.fast_cases("1-4-1")
def test_triton_mixed_batch(window: int, block_size: int, group: int) -> None:
    batch = windowed_batch(MIXED_CONTEXT, MIXED_QUERY, window, group=group, block_size=block_size,
                           seed=window + group)
    got = TRITON.paged_attention(*batch.args(), window=window)
    assert_close(got, reference.paged_attention(*batch.args(), window=window), ATTENTION_TOL[torch.float32])


@pytest.mark.parametrize("window", [2, 8, 40])
@pytest.mark.parametrize("head_dim", [64, 128])  # 128: 32-key tiles, which some rows of a tile see nothing of
@pytest.mark.fast_cases("64-2")
def test_triton_long_prefill_crosses_query_and_key_tiles(window: int, head_dim: int) -> None:
    """70 new rows over 11 cached ones: the query tiles' rows span more positions than the window, so a tile's
    later rows see none of its first key tiles."""
    batch = windowed_batch([81, 5], [70, 5], window, group=2, head_dim=head_dim, block_size=16, seed=window)
    got = TRITON.paged_attention(*batch.args(), window=window)
    assert_close(got, reference.paged_attention(*batch.args(), window=window), 1e-5)


@pytest.mark.parametrize("window", [3, 16, 37])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.fast_cases("1-3")
def test_triton_split_k_decode_skips_partitions_before_the_window(window: int, group: int) -> None:
    context, query = [1, 5, 37, 70, 16, 12], [1, 1, 1, 1, 1, 0]
    batch = windowed_batch(context, query, window, group=group, seed=group)
    expected = reference.paged_attention(*batch.args(), window=window)
    split = TRITON.paged_attention(*batch.args(), window=window, split_k=True, partition_size=16)
    direct = TRITON.paged_attention(*batch.args(), window=window, split_k=False)
    assert_close(split, expected, 1e-5)
    assert_close(direct, expected, 1e-5)


@pytest.mark.parametrize("window", [20, 33])
@pytest.mark.fast_cases("20")
def test_triton_split_k_partitions_the_window_not_the_context(window: int) -> None:
    """A long context with a short window: the split path cuts the window into partitions from its first key
    (mid-partition of the context's own grid), so cdiv(window, 16) partitions cover it whatever the context."""
    batch = windowed_batch([300, 45, 7], [1, 1, 1], window, group=2, seed=window)
    expected = reference.paged_attention(*batch.args(), window=window)
    split = TRITON.paged_attention(*batch.args(), window=window, split_k=True, partition_size=16)
    assert_close(split, expected, 1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.fast_cases("dtype0")
def test_triton_half_precision(dtype: torch.dtype) -> None:
    batch = windowed_batch(MIXED_CONTEXT, MIXED_QUERY, 6, group=2, dtype=dtype, seed=9)
    got = TRITON.paged_attention(*batch.args(), window=6)
    assert_close(got, reference.paged_attention(*batch.args(), window=6), ATTENTION_TOL[dtype])


def test_triton_rejects_an_empty_window() -> None:
    batch = make_batch([5], [1], 2, 2, 64, 4, torch.float32)
    with pytest.raises(ValueError, match="at least one position"):
        TRITON.paged_attention(*batch.args(), window=0)


# ---------------------------------------------------------------------------------------------- native CPU kernel


def cpu_args(batch) -> tuple:
    return tuple(t.cpu() if isinstance(t, torch.Tensor) else t for t in batch.args())


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.fast_cases("1-1-1")
def test_cpu_decode_only_step(window: int, block_size: int, group: int) -> None:
    contexts = [1, block_size, block_size + 1, 37, 5, 20]
    batch = windowed_batch(contexts, [1] * len(contexts), window, group=group, block_size=block_size, seed=window)
    args = cpu_args(batch)
    assert_close(CPU.paged_attention(*args, window=window), reference.paged_attention(*args, window=window),
                 ATTENTION_TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [1, 3, 6, 1000])
@pytest.mark.fast_cases("1-dtype0")
def test_cpu_mixed_step_and_drafts_being_verified(dtype: torch.dtype, window: int) -> None:
    """Decode rows and draft rows (each a token later than the one before, so each with its own window) read in
    place, beside prefill chunks attended like the reference."""
    contexts, queries = [40, 7, 9, 12, 30, 5], [4, 1, 9, 2, 20, 5]
    batch = windowed_batch(contexts, queries, window, group=3, dtype=dtype, seed=window)
    args = cpu_args(batch)
    assert_close(CPU.paged_attention(*args, window=window), reference.paged_attention(*args, window=window),
                 ATTENTION_TOL[dtype])


def test_cpu_fallback_passes_the_window_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_attention, "_library", lambda: None)
    args = cpu_args(windowed_batch(MIXED_CONTEXT, MIXED_QUERY, 4, seed=2))
    assert torch.equal(CPU.paged_attention(*args, window=4), reference.paged_attention(*args, window=4))
