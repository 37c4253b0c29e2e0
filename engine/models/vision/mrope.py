"""A step's images as the language model takes them: the placeholder rows' embeddings and the multimodal RoPE of
its image tokens (engine/multimodal.py says where the positions come from).

Qwen3.5 / 3.6 interleave the three axes over the rotary frequencies: frequency ``j`` turns by the token's height
position where ``j % 3 == 1`` (for the first ``mrope_section[1]`` of them), its width position where ``j % 3 == 2``
(the first ``mrope_section[2]``), and its time position elsewhere. A text token's three positions are equal, so its
rotation is plain RoPE: steps without image tokens never come here.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.ops import ImageSpans, Ops, with_image_spans


def mrope_axes(rotary_dim: int, section: tuple[int, int, int]) -> torch.Tensor:
    """Which axis (0: t, 1: h, 2: w) each column of a ``[positions, rotary_dim]`` cos/sin table turns by (cos half,
    then sin half)."""
    j = torch.arange(rotary_dim // 2)
    axis = torch.zeros_like(j)
    axis[(j % 3 == 1) & (j < 3 * section[1])] = 1
    axis[(j % 3 == 2) & (j < 3 * section[2])] = 2
    return torch.cat([axis, axis])


@dataclass
class MultimodalStep:
    """One step's image tokens: ``rows`` (token rows of the flattened batch) take ``embeds`` instead of their
    placeholder's embedding and turn by the (t, h, w) ``positions`` ``[3, rows]``; ``axes`` from `mrope_axes`.
    Gemma 3 takes the embeddings only, and lets an image's tokens attend to each other (``spans``)."""

    rows: torch.Tensor
    embeds: torch.Tensor
    positions: torch.Tensor
    axes: torch.Tensor | None  # None: the model's positions are 1-D (Gemma 3), `rope` is not called
    spans: ImageSpans | None = None  # image tokens that attend to each other both ways (Gemma 3)

    def attention_ops(self, ops: Ops) -> Ops:
        """The op set for this step's attention: ``ops``, or with ``spans`` the one that sees whole images."""
        return ops if self.spans is None else with_image_spans(ops, self.spans)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        return x.index_copy(0, self.rows, self.embeds.to(x.dtype))

    def rope(self, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(positions, table)`` for the rotary op: each token's own cos/sin row (its image axes mixed in) and
        positions that index them."""
        table = cos_sin_cache.index_select(0, positions.long())
        per_axis = cos_sin_cache[self.positions.long()]  # [3, rows, rotary_dim]
        mixed = per_axis.gather(0, self.axes.expand(1, per_axis.shape[1], -1)).squeeze(0)
        table = table.index_copy(0, self.rows, mixed)
        return torch.arange(len(positions), device=positions.device), table
