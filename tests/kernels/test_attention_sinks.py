"""Attention sinks (gpt-oss: one learned logit per query head that joins every row's softmax, for a key whose value
is zero), for every op set: the pure-torch reference against a float64 oracle written as transformers'
``GptOssAttention`` computes it (the logits concatenated with the sink, softmaxed, the sink's column dropped), then the
Triton kernel (under the interpreter on CPU; direct and split-K paths) and the native CPU decode kernel against the
reference, with and without sliding windows. Slots outside each window hold NaN, as in the window tests.
"""
from __future__ import annotations

import pytest
import torch

from tests.kernels.test_sliding_window import cpu_args, windowed_batch
from tests.kernels.test_triton_ops import ATTENTION_TOL, MIXED_CONTEXT, MIXED_QUERY, TRITON, assert_close, make_batch
from kernels import reference  # noqa: I001 - after the interpreter switch (tests.kernels.test_triton_ops)
from kernels.ops import get_ops

CPU = get_ops("cpu")


def head_sinks(num_heads: int, seed: int) -> torch.Tensor:
    """Sinks of a size that matters: some heads' sinks outweigh their keys, others hardly count."""
    return torch.randn(num_heads, generator=torch.Generator().manual_seed(seed)) * 3.0


def sink_oracle(batch, sinks: torch.Tensor, window: int | None) -> torch.Tensor:
    out = torch.zeros(batch.query.shape, dtype=torch.float64)
    starts, lens = batch.query_start_loc.tolist(), batch.context_lens.tolist()
    block_size, num_kv_heads = batch.k_cache.shape[1], batch.k_cache.shape[2]
    group = batch.query.shape[1] // num_kv_heads
    for b, ctx in enumerate(lens):
        q_len = starts[b + 1] - starts[b]
        for i in range(q_len):
            pos = ctx - q_len + i
            keys = range(0 if window is None else max(0, pos - window + 1), pos + 1)
            slots = [(int(batch.block_tables[b, t // block_size]), t % block_size) for t in keys]
            k = torch.stack([batch.k_cache[p, o] for p, o in slots]).double().cpu()  # [n, Hkv, D]
            v = torch.stack([batch.v_cache[p, o] for p, o in slots]).double().cpu()
            q = batch.query[starts[b] + i].double().cpu()
            for h in range(q.shape[0]):
                logits = torch.cat([k[:, h // group] @ q[h] * batch.scale, sinks[h : h + 1].double()])
                probs = torch.softmax(logits - logits.max(), dim=0)[:-1]
                out[starts[b] + i, h] = probs @ v[:, h // group]
    return out.to(batch.query.dtype)


@pytest.mark.parametrize("window", [None, 3, 6])
@pytest.mark.parametrize("block_size", [4, 16])
def test_reference_equals_transformers_formula(window: int | None, block_size: int) -> None:
    batch = windowed_batch(MIXED_CONTEXT, MIXED_QUERY, window or 10_000, group=2, block_size=block_size, seed=3)
    sinks = head_sinks(batch.query.shape[1], block_size)
    got = reference.paged_attention(*batch.args(), window=window, sinks=sinks)
    assert not got.isnan().any()
    assert_close(got.cpu(), sink_oracle(batch, sinks, window), 1e-5)
    assert not torch.allclose(got, reference.paged_attention(*batch.args(), window=window)), "the sinks count"


@pytest.mark.parametrize("window", [None, 3, 13])
@pytest.mark.parametrize("group", [1, 4])
def test_triton_mixed_batch(window: int | None, group: int) -> None:
    batch = windowed_batch(MIXED_CONTEXT, MIXED_QUERY, window or 10_000, group=group, seed=group)
    sinks = head_sinks(batch.query.shape[1], group)
    got = TRITON.paged_attention(*batch.args(), window=window, sinks=sinks)
    assert_close(got, reference.paged_attention(*batch.args(), window=window, sinks=sinks),
                 ATTENTION_TOL[torch.float32])


@pytest.mark.parametrize("window", [None, 20])
def test_triton_split_k_counts_the_sink_once(window: int | None) -> None:
    batch = windowed_batch([300, 45, 7, 1], [1, 1, 1, 1], window or 10_000, group=2, seed=7)
    sinks = head_sinks(batch.query.shape[1], 7)
    expected = reference.paged_attention(*batch.args(), window=window, sinks=sinks)
    for split in (True, False):
        got = TRITON.paged_attention(*batch.args(), window=window, sinks=sinks, split_k=split, partition_size=16)
        assert_close(got, expected, 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 1, 6])
def test_cpu_decode_and_drafts_read_in_place(dtype: torch.dtype, window: int | None) -> None:
    contexts, queries = [40, 7, 9, 12, 30, 5], [4, 1, 9, 2, 20, 1]
    batch = windowed_batch(contexts, queries, window or 10_000, group=3, dtype=dtype, seed=11)
    args, sinks = cpu_args(batch), head_sinks(batch.query.shape[1], 11)
    assert_close(CPU.paged_attention(*args, window=window, sinks=sinks),
                 reference.paged_attention(*args, window=window, sinks=sinks), ATTENTION_TOL[dtype])


def test_a_very_negative_sink_is_no_sink() -> None:
    batch = make_batch(MIXED_CONTEXT, MIXED_QUERY, 2, 2, 64, 4, torch.float32, seed=2)
    sinks = torch.full((batch.query.shape[1],), -1e4)
    plain = reference.paged_attention(*batch.args())
    for ops in (reference, TRITON):
        assert_close(ops.paged_attention(*batch.args(), sinks=sinks), plain, 1e-6)
