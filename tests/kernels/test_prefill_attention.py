"""Prefill chunks over a long cached context (an agent's next turn): the reference and the CPU op set against the
dense float64 definition, with and without attention sinks, then the Triton kernel (interpreted on CPU) against the
reference on the same batch. The chunk's rows see the whole cached prefix unmasked and their own rows causally; the
reference computes the two parts apart and merges them by their log-sum-exps, so a wrong merge, a wrong causal
alignment or a read past the context (NaN there, `make_batch`) shows here.
"""
from __future__ import annotations

import pytest
import torch

from tests.kernels.test_attention_sinks import head_sinks, sink_oracle
from tests.kernels.test_sliding_window import dense_oracle
from tests.kernels.test_triton_ops import ATTENTION_TOL, TRITON, assert_close, make_batch
from kernels import reference  # noqa: I001 - after the interpreter switch (tests.kernels.test_triton_ops)
from kernels.ops import get_ops

CPU = get_ops("cpu")
# A chunk of 37 rows after 203 cached tokens (the diagonal starts mid-page), a whole prompt, a decode, and a chunk
# whose cached prefix is exactly one page.
CONTEXTS, QUERIES = [240, 21, 64, 53], [37, 21, 1, 37]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.fast_cases("1-dtype0")
def test_chunks_over_a_cached_context_equal_the_definition(group: int, dtype: torch.dtype) -> None:
    batch = make_batch(CONTEXTS, QUERIES, 2, group, 16, 16, dtype, seed=group)
    expected = dense_oracle(batch, None)
    for ops in (reference, CPU):
        got = ops.paged_attention(*batch.args())
        assert not got.isnan().any()
        assert_close(got, expected, ATTENTION_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.fast_cases("dtype0")
def test_sinks_join_the_merged_chunk(dtype: torch.dtype) -> None:
    batch = make_batch(CONTEXTS, QUERIES, 2, 2, 16, 16, dtype, seed=5)
    sinks = head_sinks(batch.query.shape[1], 5)
    got = reference.paged_attention(*batch.args(), sinks=sinks)
    assert_close(got, sink_oracle(batch, sinks, None), ATTENTION_TOL[dtype])
    assert not torch.allclose(got.float(), reference.paged_attention(*batch.args()).float()), "the sinks count"


@pytest.mark.slow  # the interpreter: ~6 s
def test_triton_chunks_over_a_cached_context_match_the_reference() -> None:
    batch = make_batch(CONTEXTS, QUERIES, 2, 2, 16, 4, torch.float32, seed=9)
    sinks = head_sinks(batch.query.shape[1], 9)
    assert_close(TRITON.paged_attention(*batch.args()), reference.paged_attention(*batch.args()), 1e-5)
    assert_close(TRITON.paged_attention(*batch.args(), sinks=sinks),
                 reference.paged_attention(*batch.args(), sinks=sinks), 1e-5)
