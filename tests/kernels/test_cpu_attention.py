"""The native CPU decode-attention kernel (kernels/cpu/attention.py) against the pure-torch reference: the "cpu" op
set must equal the "torch" one on every batch shape, reading pages in place (every slot outside a context holds NaN,
so a read past a context poisons the output)."""
from __future__ import annotations

import os
import sys

import pytest
import torch

from tests.kernels.test_triton_ops import ATTENTION_TOL, MIXED_CONTEXT, MIXED_QUERY, assert_close, make_batch
from tests.kernels.test_mla import CONTEXTS, latent_batch
from kernels.cpu import attention as cpu_attention
from kernels import reference  # noqa: I001 - after the interpreter switch
from kernels.ops import get_ops

CPU = get_ops("cpu")
KERNELS_ON = os.environ.get("KVSERVE_CPU_KERNELS", "1") != "0"  # the whole suite also runs with them off


def on_cpu(items) -> tuple:
    return tuple(t.cpu() if isinstance(t, torch.Tensor) else t for t in items)


def test_the_kernel_builds_here_unless_turned_off() -> None:
    """The project's machines have a C compiler: the op set must not silently fall back to the reference."""
    assert cpu_attention.available() == KERNELS_ON


def test_without_the_kernel_the_op_set_is_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """No compiler, a failed build or ``KVSERVE_CPU_KERNELS=0``: decode rows go through the reference."""
    monkeypatch.setattr(cpu_attention, "_library", lambda: None)
    args = on_cpu(make_batch(MIXED_CONTEXT, MIXED_QUERY, 2, 3, 64, 4, torch.float32, seed=7).args())
    assert torch.equal(CPU.paged_attention(*args), reference.paged_attention(*args))
    batch = on_cpu(latent_batch(CONTEXTS, 16, 32, 16, 4, torch.float32, seed=3))
    assert torch.equal(CPU.mla_decode(*batch), reference.mla_decode(*batch))


@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (40, 4), (128, 1)])
def test_decode_only_step_matches_reference(group: int, head_dim: int, block_size: int) -> None:
    contexts = [1, block_size, block_size + 1, 37, 5]  # one token, a full page, a page boundary crossed, ragged
    args = on_cpu(make_batch(contexts, [1] * len(contexts), 2, group, head_dim, block_size, torch.float32,
                             seed=group).args())
    assert_close(CPU.paged_attention(*args), reference.paged_attention(*args), ATTENTION_TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_step_decodes_natively_and_prefills_like_the_reference(dtype: torch.dtype) -> None:
    args = on_cpu(make_batch(MIXED_CONTEXT, MIXED_QUERY, 2, 3, 64, 4, dtype, seed=7).args())
    assert_close(CPU.paged_attention(*args), reference.paged_attention(*args), ATTENTION_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_drafts_being_verified_are_read_in_place_each_row_causal(dtype: torch.dtype) -> None:
    """A sequence with a few query rows after its cached context (speculative drafts): each row sees one token more
    than the one before, as SDPA's causal chunk does; beside decode rows, a prompt prefilled whole, and a chunk too
    long to count as drafts."""
    contexts, queries = [40, 7, 9, 12, 30, 5], [4, 1, 9, 2, 20, 5]
    args = on_cpu(make_batch(contexts, queries, 2, 3, 64, 4, dtype, seed=11).args())
    plan = reference._AttentionPlan(args[3], args[4], args[5], 4, cpu_attention.MAX_DECODE_ROWS)
    assert plan.decode_seqs == [0, 1, 3] and plan.one_by_one == [2, 4, 5]  # drafts after a context: in place
    assert plan.decode_row_lens.tolist() == [37, 38, 39, 40, 7, 11, 12]
    assert_close(CPU.paged_attention(*args), reference.paged_attention(*args), ATTENTION_TOL[dtype])


def test_pages_it_cannot_read_fall_back_to_the_reference() -> None:
    args = on_cpu(make_batch([5, 9], [1, 1], 2, 2, 64, 4, torch.float16).args())
    assert not cpu_attention.supports(args[1])
    assert torch.equal(CPU.paged_attention(*args), reference.paged_attention(*args))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_decode_matches_reference(dtype: torch.dtype) -> None:
    batch = on_cpu(latent_batch(CONTEXTS, 16, 32, 16, 4, dtype, seed=3))
    assert_close(CPU.mla_decode(*batch), reference.mla_decode(*batch), ATTENTION_TOL[dtype])


def test_loading_the_kernel_leaves_the_process_floats_alone() -> None:
    """Built with -ffast-math, the library switched the whole process to flush denormals to zero."""
    assert cpu_attention.available() == KERNELS_ON
    assert torch.tensor([1e-40]).mul(1.0).item() > 0  # a subnormal survives a multiplication
    assert sys.float_info.min / 4 > 0
