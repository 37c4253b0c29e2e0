"""Layers split across tensor-parallel ranks, and which part of each checkpoint tensor a rank holds.

A parallel layer is an ordinary module of its rank's shapes (so an FP8 layer can still replace its ``nn.Linear``)
that carries a `Sharding`; the weight loader reads exactly the rank's rows or columns of each checkpoint tensor
through it. Collectives are not hidden inside the layers: a row-parallel layer returns this rank's partial sum, and
the decoder loop all-reduces where the partial sums meet (after attention, after the MLP), once.

- column-parallel (q/k/v, gate/up, MLA's q and kv_b): output rows split by units (heads, or single rows); when a
  fused part has fewer units than ranks (GQA's KV heads) each unit is replicated on ``size / units`` ranks.
- row-parallel (o_proj, down_proj): input columns split; a bias is held by rank 0 only, so the sum adds it once.
- vocab-parallel (embedding, LM head): vocabulary rows split in blocks of ``ceil(V / size)``, the last one padded.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.parallel.state import TensorParallel


@dataclass(frozen=True)
class Part:
    """One checkpoint tensor's share of a (possibly fused) layer: ``units`` units of ``unit_size`` rows."""

    units: int
    unit_size: int = 1


@dataclass(frozen=True)
class Sharding:
    """How a layer is split: along ``dim`` 0 (output rows: column- or vocab-parallel) or 1 (input columns)."""

    tp: TensorParallel
    dim: int
    parts: tuple[Part, ...]
    pad: bool = False  # vocab-parallel: blocks of ceil(units / size), the last rank's partly empty

    def _units(self, part: Part) -> range:
        if not self.pad:
            return self.tp.units(part.units)
        per = -(-part.units // self.tp.size)
        return range(self.tp.rank * per, min(part.units, (self.tp.rank + 1) * per))

    def _local_units(self, part: Part) -> int:
        return -(-part.units // self.tp.size) if self.pad else self.tp.split(part.units)

    @property
    def local_sizes(self) -> list[int]:
        """The rows (``dim`` 0) or columns (``dim`` 1) of each part in this rank's tensor."""
        return [self._local_units(p) * p.unit_size for p in self.parts]

    def checkpoint_index(self, attr: str, part: int) -> tuple[slice, ...] | None:
        """This rank's slice of the checkpoint tensor ``attr`` ("weight" or "bias") of part ``part``; None when the
        rank holds zeros there (a row-parallel bias beyond rank 0)."""
        if self.dim == 1 and attr == "bias":
            return (slice(None),) if self.tp.is_first else None
        units, size = self._units(self.parts[part]), self.parts[part].unit_size
        rows = slice(units.start * size, units.stop * size)
        return (slice(None),) * self.dim + (rows,)

    def full_size(self, part: int) -> int:
        """Rows (or columns) of part ``part`` in the checkpoint, over all ranks."""
        return self.parts[part].units * self.parts[part].unit_size

    def local_rows(self, part: int, num_read: int) -> slice:
        """Where ``num_read`` rows read for ``part`` go in this rank's (fused) tensor."""
        start = sum(self.local_sizes[:part])
        return slice(start, start + num_read)

    def splits(self, attr: str) -> bool:
        """Whether parameter ``attr`` holds 1/size of the checkpoint's values (memory accounting)."""
        return self.dim == 0 or attr != "bias"


def column_parallel(in_features: int, parts: list[Part], tp: TensorParallel, bias: bool = False) -> nn.Linear:
    """A linear layer holding this rank's output rows of each part (fused projections: one part each)."""
    sharding = Sharding(tp, 0, tuple(parts))
    linear = nn.Linear(in_features, sum(sharding.local_sizes), bias=bias)
    linear.sharding = sharding
    return linear


def row_parallel(in_features: int, out_features: int, tp: TensorParallel, bias: bool = False,
                 unit_size: int = 1) -> nn.Linear:
    """A linear layer holding this rank's input columns (in units of ``unit_size``: heads); returns partial sums."""
    sharding = Sharding(tp, 1, (Part(in_features // unit_size, unit_size),))
    linear = nn.Linear(sharding.local_sizes[0], out_features, bias=bias)
    linear.sharding = sharding
    return linear


def qkv_parallel(hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, tp: TensorParallel,
                 bias: bool, q_unit: int | None = None) -> nn.Linear:
    """The fused q/k/v projection of this rank's query heads and the KV heads they read (``q_unit``: rows per query
    head, when q_proj gives more than the query, e.g. a gate per head)."""
    return column_parallel(hidden_size, [Part(num_heads, q_unit or head_dim), Part(num_kv_heads, head_dim),
                                         Part(num_kv_heads, head_dim)], tp, bias)


class VocabParallelEmbedding(nn.Module):
    """This rank's block of embedding rows; ids outside it embed as zeros, so the all-reduce of the decoder loop
    assembles every token's embedding."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.sharding = vocab_sharding(vocab_size, tp)
        rows = self.sharding.local_sizes[0]
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))
        self.first_id = tp.rank * rows
        self.single = tp.size == 1

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.single:
            return F.embedding(ids, self.weight)
        local = ids - self.first_id
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return out.masked_fill(outside.unsqueeze(-1), 0.0)


def vocab_sharding(vocab_size: int, tp: TensorParallel) -> Sharding:
    return Sharding(tp, 0, (Part(vocab_size),), pad=True)


def lm_head_parallel(hidden_size: int, vocab_size: int, tp: TensorParallel) -> nn.Linear:
    """The output head's block of vocabulary rows (the embedding's block, when tied); logits are gathered."""
    sharding = vocab_sharding(vocab_size, tp)
    linear = nn.Linear(hidden_size, sharding.local_sizes[0], bias=False)
    linear.sharding = sharding
    return linear


@dataclass(frozen=True)
class ExpertSharding:
    """Routed experts across ranks: a 1/size slice of every expert's intermediate dim (tensor parallel), or whole
    experts, 1/size of them per rank (expert parallel). Either way each rank's output is a partial sum."""

    tp: TensorParallel
    num_experts: int
    intermediate_size: int

    @property
    def local_experts(self) -> range:
        return self.tp.units(self.num_experts) if self.tp.expert_parallel else range(self.num_experts)

    @property
    def local_intermediate(self) -> int:
        return self.intermediate_size if self.tp.expert_parallel else self.tp.split(self.intermediate_size)

    def local_index(self, expert: int) -> int | None:
        """Where checkpoint expert ``expert`` sits in this rank's stack; None when another rank holds it."""
        local = self.local_experts
        return expert - local.start if expert in local else None

    def checkpoint_index(self, projection: str) -> tuple[slice, ...]:
        """This rank's slice of one expert's ``gate_proj`` / ``up_proj`` ``[I, H]`` or ``down_proj`` ``[H, I]``."""
        if self.tp.expert_parallel:
            return (slice(None),)
        units = self.tp.units(self.intermediate_size)
        rows = slice(units.start, units.stop)
        return (slice(None), rows) if projection == "down_proj" else (rows,)

    def localize(self, ids: torch.Tensor) -> torch.Tensor:
        """Routed expert ids as this rank's stack indexes them; -1 for experts held by other ranks."""
        if not self.tp.expert_parallel or self.tp.size == 1:
            return ids
        local = ids - self.local_experts.start
        return local.masked_fill((local < 0) | (local >= len(self.local_experts)), -1)

    def splits(self, attr: str) -> bool:
        return True

