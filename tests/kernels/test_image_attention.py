"""kernels/reference/image_attention.py: a step's image rows re-attended over their sequence's pages as
transformers' Gemma 3 mask has them (causal OR the same image, AND the window in sliding layers), under any op set
(`with_image_spans` wraps its paged attention: the reference, the CPU set, Triton under the interpreter); the other rows keep the causal attention. Checked against a dense
masked softmax over the whole sequence, with GQA, pages out of order, a chunk that starts inside the image (a
prefix hit ending in it) and one that starts before it, windowed and not."""
from __future__ import annotations

import pytest
import torch

from tests.kernels.test_triton_ops import DEVICE, TRITON  # sets TRITON_INTERPRET first
from kernels.ops import ImageSpans, get_ops, with_image_spans  # noqa: I001 - after the interpreter switch

OP_SETS = {"torch": get_ops("torch"), "cpu": get_ops("cpu"), "triton": TRITON}

BLOCK, HQ, HKV, D = 4, 4, 2, 8
LENGTH, IMAGE = 30, (14, 26)  # the sequence's tokens; the image's [start, end)


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, window: int | None):
    """Rows at ``q_pos`` over every key, masked as transformers masks Gemma 3 (scale 1/sqrt(D))."""
    k_pos = torch.arange(k.shape[0])
    mask = (k_pos[None] <= q_pos[:, None]) | ((k_pos[None] >= IMAGE[0]) & (k_pos[None] < IMAGE[1])
                                              & (q_pos[:, None] >= IMAGE[0]) & (q_pos[:, None] < IMAGE[1]))
    if window is not None:
        mask &= k_pos[None] > q_pos[:, None] - window
    k, v = k.repeat_interleave(HQ // HKV, 1), v.repeat_interleave(HQ // HKV, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * D ** -0.5
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~mask, float("-inf")).softmax(-1), v)


@pytest.mark.parametrize("op_set", list(OP_SETS))
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("chunk_start", [10, 16])
def test_image_rows_see_their_whole_image(window, chunk_start, op_set):
    torch.manual_seed(0)
    causal_ops = OP_SETS[op_set]
    k, v = torch.randn(LENGTH, HKV, D), torch.randn(LENGTH, HKV, D)
    blocks = -(-LENGTH // BLOCK)
    table = torch.randperm(blocks + 3)[:blocks]  # pages out of order, some unused
    k_cache, v_cache = torch.zeros(blocks + 3, BLOCK, HKV, D), torch.zeros(blocks + 3, BLOCK, HKV, D)
    slots = table[torch.arange(LENGTH) // BLOCK] * BLOCK + torch.arange(LENGTH) % BLOCK
    k_cache.view(-1, HKV, D)[slots], v_cache.view(-1, HKV, D)[slots] = k, v
    q_pos = torch.arange(chunk_start, LENGTH)
    q = torch.randn(len(q_pos), HQ, D)
    first = max(IMAGE[0], chunk_start)
    spans = ImageSpans((0,), (first - chunk_start,), (first,), (IMAGE[0],), (IMAGE[1],))
    args = (q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), table[None].int().to(DEVICE),
            torch.tensor([LENGTH], dtype=torch.int32, device=DEVICE),
            torch.tensor([0, len(q_pos)], dtype=torch.int32, device=DEVICE), D ** -0.5)
    hints = dict(window=window, max_query_len=len(q_pos), max_context_len=LENGTH)
    out = with_image_spans(causal_ops, spans).paged_attention(*args, **hints).cpu()
    want = _dense(q, k, v, q_pos, window)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    causal = causal_ops.paged_attention(*args, **hints).cpu()
    inside = (q_pos >= IMAGE[0]) & (q_pos < IMAGE[1] - 1)
    assert (out[inside] - causal[inside]).abs().amax() > 1e-2, "the image rows changed"
    torch.testing.assert_close(out[~inside], causal[~inside])
