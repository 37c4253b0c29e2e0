"""What each rank holds: its weights (split across ranks, or replicated on every rank) and its KV blocks."""
from __future__ import annotations

import os
from dataclasses import dataclass

from torch import nn

from engine.models.kv_cache_spec import KVCaches

MIB = 2**20


@dataclass(frozen=True)
class RankMemory:
    rank: int
    device: str
    pid: int
    sharded_weight_bytes: int  # this rank's part of the tensors split across ranks
    replicated_weight_bytes: int  # tensors every rank holds in full (norms, routers, MLA's latent projections)
    kv_cache_bytes: int

    @property
    def weight_bytes(self) -> int:
        return self.sharded_weight_bytes + self.replicated_weight_bytes

    def describe(self) -> str:
        return (f"rank {self.rank} ({self.device}, pid {self.pid}): weights {self.weight_bytes / MIB:,.1f} MiB "
                f"({self.sharded_weight_bytes / MIB:,.1f} sharded + {self.replicated_weight_bytes / MIB:,.1f} "
                f"replicated), KV blocks {self.kv_cache_bytes / MIB:,.1f} MiB")


def weight_bytes(model: nn.Module) -> tuple[int, int]:
    """``(sharded, replicated)`` bytes of this rank's parameters: those of layers with a sharding that splits them
    (engine/parallel/linear.py), and the rest (a row-parallel bias is whole on every rank)."""
    sharded = replicated = 0
    seen: set[int] = set()
    for module in model.modules():
        sharding = getattr(module, "sharding", None)
        for attr, param in module.named_parameters(recurse=False):
            if id(param) in seen:  # a tied output head shares the embedding's rows
                continue
            seen.add(id(param))
            size = param.numel() * param.element_size()
            if sharding is not None and sharding.splits(attr):
                sharded += size
            else:
                replicated += size
    return sharded, replicated


def measure(rank: int, model: nn.Module, kv_caches: KVCaches) -> RankMemory:
    sharded, replicated = weight_bytes(model)
    kv = sum(t.numel() * t.element_size() for layer in kv_caches for t in layer)
    device = str(next(model.parameters()).device)
    return RankMemory(rank, device, os.getpid(), sharded, replicated, kv)
