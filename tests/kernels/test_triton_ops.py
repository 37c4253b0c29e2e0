"""Every Triton kernel against its pure-torch reference: on CPU through the Triton interpreter, natively on a GPU.

The device is CUDA when one is present, else the CPU; ``KVSERVE_KERNEL_TEST_DEVICE=cpu|cuda`` picks it explicitly.

Tolerances (``torch.testing.assert_close`` atol = rtol): fp32 1e-5; fp16 2e-3 (elementwise) / 5e-3 (attention);
bf16 2e-2 (elementwise) / 3e-2 (attention). bf16 is looser because the interpreter casts fp32 -> bf16 by truncation
(the GPU rounds to nearest), so results may differ from the reference by one bf16 ulp (2^-8 relative) per cast.
"""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, replace

import pytest
import torch

DEVICE = os.environ.get("KVSERVE_KERNEL_TEST_DEVICE", "cuda" if torch.cuda.is_available() else "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first triton import (kernels import triton)

from kernels import reference  # noqa: E402 - after the interpreter switch
from kernels.ops import get_ops  # noqa: E402
from kernels.triton.attention import SPLIT_K_ENV, choose_partition_size, use_split_k  # noqa: E402

TRITON = get_ops("triton")

ELEMENTWISE_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
ATTENTION_TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)


# ---------------------------------------------------------------------------------------------------------- paging


@dataclass
class PagedBatch:
    query: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_start_loc: torch.Tensor
    scale: float

    def args(self) -> tuple:
        return (self.query, self.k_cache, self.v_cache, self.block_tables, self.context_lens,
                self.query_start_loc, self.scale)


def make_batch(
    context_lens: list[int],
    query_lens: list[int],
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
) -> PagedBatch:
    """A flattened batch whose sequences own shuffled pages. Every cache slot outside a context holds NaN, and block
    table padding points at an all-NaN page, so reading past a context poisons the output."""
    gen = torch.Generator().manual_seed(seed)
    pages_per_seq = [-(-c // block_size) for c in context_lens]
    num_pages = sum(pages_per_seq) + 2  # + spare pages left NaN
    shape = (num_pages, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    order = torch.randperm(num_pages, generator=gen).tolist()
    nan_page = order.pop()
    block_tables = torch.full((len(context_lens), max(max(pages_per_seq), 1) + 1), nan_page, dtype=torch.int32)
    for b, (ctx, n_pages) in enumerate(zip(context_lens, pages_per_seq)):
        pages = [order.pop() for _ in range(n_pages)]
        block_tables[b, :n_pages] = torch.tensor(pages, dtype=torch.int32)
        for pos in range(ctx):
            page, off = pages[pos // block_size], pos % block_size
            k_cache[page, off] = torch.randn(num_kv_heads, head_dim, generator=gen).to(dtype)
            v_cache[page, off] = torch.randn(num_kv_heads, head_dim, generator=gen).to(dtype)
    starts = [0]
    for q_len, ctx in zip(query_lens, context_lens):
        assert q_len <= ctx
        starts.append(starts[-1] + q_len)
    query = torch.randn(starts[-1], num_kv_heads * group, head_dim, generator=gen).to(dtype)
    tensors = (query, k_cache, v_cache, block_tables, torch.tensor(context_lens, dtype=torch.int32),
               torch.tensor(starts, dtype=torch.int32))
    return PagedBatch(*(t.to(DEVICE) for t in tensors), head_dim ** -0.5)


# A mixed step: a prefill chunk over a cached prefix, a whole prompt, decodes (one at context length 1, one just
# past a block boundary), a sequence with no new rows this step, and a long single-row decode.
MIXED_CONTEXT = [23, 13, 18, 1, 9, 17, 30]
MIXED_QUERY = [9, 13, 1, 1, 0, 1, 4]


# ------------------------------------------------------------------------------------------------------- store_kv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.fast_cases("4-dtype0")
def test_store_kv_matches_reference_and_skips_padding(dtype: torch.dtype, block_size: int) -> None:
    num_tokens, num_kv_heads, head_dim = 9, 2, 64
    # key/value as strided views of a fused qkv projection, the layout the model hands over
    qkv = torch.randn(num_tokens, (4 + 2 * num_kv_heads) * head_dim).to(DEVICE, dtype)
    key = qkv[:, 4 * head_dim:(4 + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, head_dim)
    value = qkv[:, (4 + num_kv_heads) * head_dim:].view(num_tokens, num_kv_heads, head_dim)
    num_slots = 5 * block_size
    slots = torch.randperm(num_slots)[:num_tokens].to(DEVICE)
    slots[[1, 6]] = -1  # padding rows
    k_ref = torch.randn(5, block_size, num_kv_heads, head_dim).to(DEVICE, dtype)
    v_ref = torch.randn_like(k_ref)
    k_out, v_out = k_ref.clone(), v_ref.clone()
    reference.store_kv(key, value, k_ref, v_ref, slots)
    TRITON.store_kv(key, value, k_out, v_out, slots)
    assert torch.equal(k_out, k_ref) and torch.equal(v_out, v_ref)
    # the padding rows' data is nowhere in the cache
    for row in (1, 6):
        assert not (k_out.view(-1, num_kv_heads, head_dim) == key[row]).all(-1).all(-1).any()


def test_store_kv_all_padding_and_empty_batch() -> None:
    k_cache = torch.randn(3, 4, 2, 64, device=DEVICE)
    v_cache = torch.randn(3, 4, 2, 64, device=DEVICE)
    before = (k_cache.clone(), v_cache.clone())
    key = torch.randn(3, 2, 64, device=DEVICE)
    TRITON.store_kv(key, key, k_cache, v_cache, torch.full((3,), -1, device=DEVICE))
    TRITON.store_kv(key[:0], key[:0], k_cache, v_cache, torch.empty(0, dtype=torch.int64, device=DEVICE))
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


# ------------------------------------------------------------------------------------------------ paged attention


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.fast_cases("1-64-4")
def test_paged_attention_mixed_batch_fp32(group: int, head_dim: int, block_size: int) -> None:
    batch = make_batch(MIXED_CONTEXT, MIXED_QUERY, 2, group, head_dim, block_size, torch.float32, seed=group)
    expected = reference.paged_attention(*batch.args())
    assert_close(TRITON.paged_attention(*batch.args()), expected, ATTENTION_TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.fast_cases("1-dtype0")
def test_paged_attention_mixed_batch_half(dtype: torch.dtype, group: int) -> None:
    batch = make_batch(MIXED_CONTEXT, MIXED_QUERY, 2, group, 64, 4, dtype, seed=7)
    expected = reference.paged_attention(*batch.args())
    assert_close(TRITON.paged_attention(*batch.args()), expected, ATTENTION_TOL[dtype])


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.fast_cases("1")
def test_paged_attention_lone_decode_beside_a_prefill(group: int) -> None:
    # A single decode row goes through the batched decode path (a batch of one) beside a prefill chunk.
    batch = make_batch([37, 12], [1, 5], 2, group, 64, 16, torch.float32, seed=11)
    assert_close(TRITON.paged_attention(*batch.args()), reference.paged_attention(*batch.args()), 1e-5)


def test_reference_plan_follows_metadata_changed_in_place() -> None:
    # The reference derives its gather plan once per step and reuses it while the same metadata tensors come back
    # unchanged (every layer of a step). The runner rewrites those buffers in place between steps: the next call
    # must read the new lengths, exactly as a call on fresh tensors does.
    batch = make_batch([23, 18, 9, 30], [1, 1, 1, 1], 2, 2, 64, 4, torch.float32, seed=5)
    before = reference.paged_attention(*batch.args())
    assert torch.equal(reference.paged_attention(*batch.args()), before)
    batch.context_lens.copy_(torch.tensor([20, 18, 5, 30], dtype=torch.int32))
    fresh = replace(batch, block_tables=batch.block_tables.clone(), context_lens=batch.context_lens.clone(),
                    query_start_loc=batch.query_start_loc.clone())
    after = reference.paged_attention(*batch.args())
    assert torch.equal(after, reference.paged_attention(*fresh.args()))
    assert not torch.allclose(after[0], before[0]) and not torch.allclose(after[2], before[2])
    assert torch.equal(after[1], before[1])


def test_reference_scratch_serves_calls_in_and_out_of_inference_mode() -> None:
    # Decode gathers reuse per-thread scratch buffers. The engine runs under inference mode, tests and tools call
    # outside it: a buffer made in one mode must not be written in the other (an inference tensor refuses in-place
    # writes outside inference mode), and a later, larger batch grows the buffer without touching earlier results.
    small = make_batch([23, 18, 9, 30], [1, 1, 1, 1], 2, 2, 64, 4, torch.float32, seed=6)
    large = make_batch([57, 41, 9, 30, 66, 12], [1] * 6, 2, 2, 64, 4, torch.float32, seed=7)
    with torch.inference_mode():
        inside = reference.paged_attention(*small.args())
    outside = reference.paged_attention(*small.args())
    assert torch.equal(inside, outside)
    first = outside.clone()
    assert_close(reference.paged_attention(*large.args()), TRITON.paged_attention(*large.args()), 1e-5)
    assert torch.equal(outside, first) and torch.equal(reference.paged_attention(*small.args()), first)


def test_paged_attention_long_prefill_crosses_query_tiles() -> None:
    # 70 new rows x group 2 spans three 64-row tiles; the prefix makes the causal diagonal start mid-block.
    batch = make_batch([81, 5], [70, 5], 1, 2, 64, 16, torch.float32, seed=3)
    assert_close(TRITON.paged_attention(*batch.args()), reference.paged_attention(*batch.args()), 1e-5)


def test_paged_attention_strided_query_and_grid_upper_bounds() -> None:
    """A query sliced out of a fused qkv tensor, and oversized grid bounds as a CUDA-graph capture would pass."""
    batch = make_batch(MIXED_CONTEXT, MIXED_QUERY, 2, 2, 64, 4, torch.float32, seed=11)
    tokens, heads, dim = batch.query.shape
    qkv = torch.randn(tokens, heads * dim + 2 * 2 * dim, device=DEVICE)
    qkv[:, : heads * dim] = batch.query.reshape(tokens, -1)
    batch.query = qkv[:, : heads * dim].view(tokens, heads, dim)
    assert not batch.query.is_contiguous()
    expected = reference.paged_attention(*batch.args())
    out = TRITON.paged_attention(*batch.args(), max_query_len=32, max_context_len=200)
    assert_close(out, expected, 1e-5)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.slow
def test_paged_attention_split_k_decode(group: int, head_dim: int) -> None:
    # partition_size 16 splits these contexts into up to 5 partitions; one sequence has no row this step.
    context, query = [1, 5, 37, 70, 16, 12], [1, 1, 1, 1, 1, 0]
    batch = make_batch(context, query, 2, group, head_dim, 4, torch.float32, seed=head_dim + group)
    expected = reference.paged_attention(*batch.args())
    split = TRITON.paged_attention(*batch.args(), split_k=True, partition_size=16)
    direct = TRITON.paged_attention(*batch.args(), split_k=False)
    assert_close(split, expected, 1e-5)
    assert_close(direct, expected, 1e-5)


@pytest.mark.slow
def test_paged_attention_split_k_reduce_spans_several_partition_tiles() -> None:
    # partition_size 4 cuts a 70-token context into 18 partitions: the reduce walks two 16-partition tiles.
    batch = make_batch([70, 3, 33], [1, 1, 1], 2, 2, 64, 4, torch.float32, seed=13)
    # A dominant key in the last partition: its score (~230 in log2 units) overflows exp2 unless the reduce takes
    # the maximum over every tile, not just the first.
    page, offset = int(batch.block_tables[0, 69 // 4]), 69 % 4
    batch.k_cache[page, offset, 0] = 20 * batch.query[0, 0]
    split = TRITON.paged_attention(*batch.args(), split_k=True, partition_size=4)
    assert_close(split, reference.paged_attention(*batch.args()), 1e-5)


@pytest.mark.parametrize("group", [3, 7])  # e.g. Qwen2.5-7B: 28 query heads over 4 KV heads
@pytest.mark.fast_cases("3")
def test_paged_attention_non_power_of_two_group(group: int) -> None:
    batch = make_batch([19, 6, 33], [5, 1, 1], 2, group, 64, 4, torch.float32, seed=group)
    assert_close(TRITON.paged_attention(*batch.args()), reference.paged_attention(*batch.args()), 1e-5)
    decode = make_batch([19, 6, 33], [1, 1, 1], 2, group, 64, 4, torch.float32, seed=group)
    split = TRITON.paged_attention(*decode.args(), split_k=True, partition_size=16)
    assert_close(split, reference.paged_attention(*decode.args()), 1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.fast_cases("dtype0")
def test_paged_attention_split_k_half(dtype: torch.dtype) -> None:
    batch = make_batch([3, 45, 64], [1, 1, 1], 2, 2, 64, 16, dtype, seed=5)
    split = TRITON.paged_attention(*batch.args(), split_k=True, partition_size=16, max_context_len=100)
    assert_close(split, reference.paged_attention(*batch.args()), ATTENTION_TOL[dtype])


def test_split_k_env_override_and_heuristics(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    monkeypatch.delenv(SPLIT_K_ENV, raising=False)
    assert not use_split_k(1, 8, 1, 500, cpu)  # short context: not worth a second launch
    assert not use_split_k(1, 8, 1, 4096, cpu)  # CPU counts as 1 compute unit: 8 programs already fill it
    assert not use_split_k(1, 8, 5, 4096, cpu)  # prefill rows never split
    with monkeypatch.context() as patch:  # an H200-sized device: 132 SMs
        patch.setattr("kernels.triton.attention.num_compute_units", lambda device: 132)
        assert use_split_k(1, 8, 1, 4096, cpu) and use_split_k(32, 8, 1, 2048, cpu)
        assert not use_split_k(256, 8, 1, 4096, cpu)  # 2048 programs fill the GPU already
        assert choose_partition_size(1, 8, 4096, cpu) == 128  # 32 partitions x 8 heads = 2 programs per SM
        assert choose_partition_size(1, 8, 1100, cpu) == 64  # the smallest partition
        assert choose_partition_size(64, 8, 100_000, cpu) == 512  # the largest
    monkeypatch.setenv(SPLIT_K_ENV, "1")
    assert use_split_k(256, 8, 1, 10, cpu)
    assert not use_split_k(1, 8, 2, 4096, cpu)
    monkeypatch.setenv(SPLIT_K_ENV, "0")
    assert not use_split_k(1, 1, 1, 100_000, cpu)

    # the env switch reaches the op: forced split with tiny partitions still matches the reference
    monkeypatch.setenv(SPLIT_K_ENV, "1")
    batch = make_batch([40, 9], [1, 1], 1, 2, 64, 4, torch.float32, seed=2)
    expected = reference.paged_attention(*batch.args())
    assert_close(TRITON.paged_attention(*batch.args(), partition_size=16), expected, 1e-5)
    assert_close(TRITON.paged_attention(*batch.args()), expected, 1e-5)  # partition size chosen by the heuristic


def test_split_k_rejects_prefill_rows() -> None:
    batch = make_batch([8], [3], 1, 1, 64, 4, torch.float32)
    with pytest.raises(ValueError, match="decode-only"):
        TRITON.paged_attention(*batch.args(), split_k=True)


def test_paged_attention_empty_batch() -> None:
    batch = make_batch([5, 3], [0, 0], 1, 2, 64, 4, torch.float32)
    assert TRITON.paged_attention(*batch.args()).shape == (0, 2, 64)


# ------------------------------------------------------------------------------------------------------- rms_norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hidden", [64, 96, 1100])  # 38 rows: one, two and nineteen multi-row programs
@pytest.mark.fast_cases("64-dtype0")
def test_rms_norm_matches_reference(dtype: torch.dtype, hidden: int) -> None:
    x = torch.randn(2, 19, hidden).to(DEVICE, dtype)
    weight = (1 + 0.5 * torch.randn(hidden)).to(DEVICE, dtype)
    assert_close(TRITON.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6), ELEMENTWISE_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.fast_cases("dtype0")
def test_rms_norm_fused_residual(dtype: torch.dtype) -> None:
    x = torch.randn(7, 96).to(DEVICE, dtype)
    residual = torch.randn(7, 96).to(DEVICE, dtype)
    weight = torch.randn(96).to(DEVICE, dtype)
    inputs = (x.clone(), residual.clone())
    out, res_out = TRITON.rms_norm(x, weight, 1e-5, residual)
    ref_out, ref_res = reference.rms_norm(x, weight, 1e-5, residual)
    assert_close(out, ref_out, ELEMENTWISE_TOL[dtype])
    assert_close(res_out, ref_res, ELEMENTWISE_TOL[dtype])
    assert torch.equal(x, inputs[0]) and torch.equal(residual, inputs[1])  # inputs untouched, like the reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.fast_cases("dtype0")
def test_rms_norm_per_head_on_a_fused_qkv_view(dtype: torch.dtype) -> None:
    """Qwen3's q/k norm: per-head rows of a strided [T, H, D] slice of the qkv projection."""
    tokens, heads, dim = 5, 4, 128
    qkv = torch.randn(tokens, (heads + 4) * dim).to(DEVICE, dtype)
    q = qkv[:, : heads * dim].view(tokens, heads, dim)
    weight = torch.randn(dim).to(DEVICE, dtype)
    assert not q.is_contiguous()
    assert_close(TRITON.rms_norm(q, weight, 1e-6), reference.rms_norm(q, weight, 1e-6), ELEMENTWISE_TOL[dtype])


def test_rms_norm_fp32_weight_promotes_like_reference() -> None:
    x = torch.randn(3, 64).to(DEVICE, torch.bfloat16)
    weight = torch.randn(64, device=DEVICE)
    assert_close(TRITON.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6), 2e-2)


# ---------------------------------------------------------------------------------------------------------- rotary


def neox_cache(max_pos: int, dim: int, theta: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2).float() / dim)
    angles = torch.arange(max_pos).float()[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.fast_cases("64-dtype0")
def test_rotary_embedding_matches_reference(dtype: torch.dtype, head_dim: int) -> None:
    tokens, q_heads, kv_heads = 6, 4, 2
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim).to(DEVICE, dtype)
    query = qkv[:, : q_heads * head_dim].view(tokens, q_heads, head_dim)
    key = qkv[:, q_heads * head_dim:(q_heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    positions = torch.tensor([0, 1, 63, 7, 7, 40], device=DEVICE)
    cache = neox_cache(64, head_dim)
    before = qkv.clone()
    q_out, k_out = TRITON.rotary_embedding(positions, query, key, cache)
    q_ref, k_ref = reference.rotary_embedding(positions, query, key, cache)
    assert_close(q_out, q_ref, ELEMENTWISE_TOL[dtype])
    assert_close(k_out, k_ref, ELEMENTWISE_TOL[dtype])
    assert torch.equal(qkv, before)


# ---------------------------------------------------------------------------------------------------- silu_and_mul


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 2 * 96), (2, 3, 2 * 1100)])  # 1100 spans two 1024-wide column blocks
@pytest.mark.fast_cases("shape0-dtype0")
def test_silu_and_mul_matches_reference(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    x = (2 * torch.randn(shape)).to(DEVICE, dtype)
    assert_close(TRITON.silu_and_mul(x), reference.silu_and_mul(x), ELEMENTWISE_TOL[dtype])


def test_elementwise_ops_accept_empty_batches() -> None:
    x = torch.randn(0, 64, device=DEVICE)
    assert TRITON.silu_and_mul(x).shape == (0, 32)
    assert TRITON.rms_norm(x, torch.ones(64, device=DEVICE), 1e-6).shape == (0, 64)
    positions = torch.zeros(0, dtype=torch.long, device=DEVICE)
    q, k = TRITON.rotary_embedding(positions, torch.randn(0, 2, 64, device=DEVICE),
                                   torch.randn(0, 1, 64, device=DEVICE), neox_cache(4, 64))
    assert q.shape == (0, 2, 64) and k.shape == (0, 1, 64)


# ------------------------------------------------------------------------------------------- GPU compilation (AOT)


@pytest.mark.skipif(DEVICE == "cuda", reason="on a GPU the tests above compile every kernel for real; this stand-in "
                    "intercepts launches through Triton internals that differ between Triton versions")
@pytest.mark.slow
def test_every_kernel_compiles_for_sm90() -> None:
    """The real compiler (not the interpreter) accepts every launch the wrappers make at Qwen3-0.6B shapes."""
    from triton.backends import backends

    if "nvidia" not in backends:
        pytest.skip("this Triton build has no NVIDIA backend to compile with")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "kernels.triton.aot", "--arch", "90"], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    compiled = [line.split()[1] for line in result.stdout.splitlines() if line.startswith("ok ")]
    assert {"_paged_attention_kernel", "_reduce_partitions_kernel", "_rms_norm_kernel", "_gated_act_kernel",
            "_rotary_kernel", "_store_kv_kernel", "_fp8_block_gemm_kernel", "_grouped_gemm_kernel",
            "_mla_decode_kernel", "_mxfp4_moe_kernel", "_causal_conv1d_kernel", "_fused_recurrent_kernel",
            "_chunk_prepare_kernel", "_chunk_scan_kernel"} <= set(compiled)
    # The chunked delta rule of a bf16 model (TF32 dots) keeps its tiles in registers: in the FMA form over 4 warps
    # it spilled 15 / 35 KB a thread, and a 16k-token prefill step of Qwen3.6-35B-A3B took about 20 s on an H200.
    chunked = [line for line in result.stdout.splitlines()
               if line.split()[1] in ("_chunk_prepare_kernel", "_chunk_scan_kernel") and "DOT_PRECISION=tf32" in line]
    stacks = [int(line.split("stack=")[1].split("B")[0]) for line in chunked if "stack=None" not in line]
    assert len(chunked) == 2 and all(stack <= 2048 for stack in stacks), chunked
