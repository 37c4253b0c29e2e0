"""Attention among an image's tokens both ways (Gemma 3: transformers' ``token_type_ids`` mask, causal OR within
the same image; in sliding-window layers AND the window; Gemma 4: the same in its sliding-window layers alone, its
global layers causal), as a pure-torch fix-up after the causal paged attention
of any op set (`with_image_spans` wraps its ``paged_attention``): the step's image query rows are attended again,
each over its sequence's keys up to its image's end, which the step has just stored. Only steps that compute image
tokens of such a model come here.

It needs every image's tokens after a query row in the same step: the scheduler never ends a prefill chunk inside
such an image (engine/sched/image_encoding.py). A chunk may start inside one (a prefix-cache hit ending in it): the
cached tokens' K/V were computed with the whole image, by the same content hash.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.op_set import Ops
from kernels.reference import gather_context


@dataclass(frozen=True)
class ImageSpans:
    """The step's image query rows, one entry per image slice: the sequence's row in the block tables, the first
    query row in the flattened batch, the position of that row, and the image's first and end positions."""

    seq_rows: tuple[int, ...]
    query_rows: tuple[int, ...]
    first_positions: tuple[int, ...]
    starts: tuple[int, ...]
    ends: tuple[int, ...]
    window_layers_only: bool = False  # Gemma 4: the global layers (no window) attend causally


def attend_within_images(out: torch.Tensor, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, spans: ImageSpans, scale: float,
                         window: int | None = None) -> torch.Tensor:
    """``out`` ``[T, Hq, D]`` (the causal attention of ``query``) with the image rows of ``spans`` replaced."""
    out = out.clone()
    for b, row, first, start, end in zip(spans.seq_rows, spans.query_rows, spans.first_positions, spans.starts,
                                         spans.ends):
        n = end - first
        lo = max(0, first - window + 1) if window is not None else 0
        k = gather_context(k_cache, block_tables[b], end, lo).transpose(0, 1)[None].to(query.dtype)
        v = gather_context(v_cache, block_tables[b], end, lo).transpose(0, 1)[None].to(query.dtype)
        q_pos = torch.arange(first, end, device=query.device)[:, None]
        k_pos = torch.arange(lo, end, device=query.device)[None, :]
        mask = (k_pos <= q_pos) | (k_pos >= start)  # causal, or inside the image (k_pos < end always)
        if window is not None:
            mask &= k_pos > q_pos - window
        q = query[row:row + n].transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[row:row + n] = o[0].transpose(0, 1).to(out.dtype)
    return out


def with_image_spans(ops: Ops, spans: ImageSpans) -> Ops:
    """``ops`` whose paged attention lets the step's image rows of ``spans`` see their whole image."""
    causal = ops.paged_attention

    def paged_attention(query, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, **kw):
        out = causal(query, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, **kw)
        if spans.window_layers_only and kw.get("window") is None:
            return out
        return attend_within_images(out, query, k_cache, v_cache, block_tables, spans, scale, kw.get("window"))

    return dataclasses.replace(ops, paged_attention=paged_attention)
