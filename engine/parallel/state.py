"""This process's place in the tensor-parallel group: its rank, the process groups, and the collectives the model
calls.

Two process groups. ``group`` carries the model's collectives (NCCL on CUDA, gloo on CPU), issued in step order by
whichever thread runs the device work. ``channel`` (always gloo) carries rank 0's `SchedulerOutput` of each step to
the other ranks, from the engine thread. Two threads never share one group, so their collectives cannot interleave
in different orders on different ranks.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# Collectives of the model: the first one after start-up waits for the slowest rank to load its weights.
MODEL_GROUP_TIMEOUT = timedelta(hours=1)
# The step channel: an idle server's workers wait on it for as long as nobody sends a request.
CHANNEL_TIMEOUT = timedelta(days=365)
# The rendezvous store: every rank checks in first (see `join_group`), so joining takes moments once all have.
STORE_TIMEOUT = timedelta(minutes=5)

# torch numbers process groups with a process-wide counter that a join which never finished leaves advanced; the
# ranks would then disagree on the groups' names and wait forever. Such a process refuses further joins.
_unfinished_join = False


@dataclass(frozen=True)
class TensorParallel:
    """Rank ``rank`` of ``size``; with ``size`` 1 every collective is the identity and no process group exists."""

    rank: int = 0
    size: int = 1
    expert_parallel: bool = False  # MoE layers hold whole experts per rank instead of a slice of each
    group: dist.ProcessGroup | None = None

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of each rank's partial ``x`` (in place)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def gather_to_first(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's ``x`` concatenated along the last dim, on rank 0; None on the others."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.is_first else None
        dist.gather(x, parts, dst=0, group=self.group)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def broadcast_from_first(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` on every rank (in place)."""
        if self.size > 1:
            dist.broadcast(x, src=0, group=self.group)
        return x

    def min(self, value: int, device: torch.device) -> int:
        """The smallest of the ranks' ``value`` (e.g. KV blocks that fit everywhere)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.long, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def units(self, n: int) -> range:
        """Which of ``n`` units (heads, rows, experts) this rank holds: a contiguous ``n / size`` of them, or, when
        there are fewer units than ranks, one unit shared by ``size / n`` ranks (KV heads under GQA)."""
        if n >= self.size:
            assert n % self.size == 0, f"{n} units do not split over {self.size} ranks"
            per = n // self.size
            return range(self.rank * per, (self.rank + 1) * per)
        assert self.size % n == 0, f"{n} units cannot be replicated evenly over {self.size} ranks"
        unit = self.rank * n // self.size
        return range(unit, unit + 1)

    def split(self, n: int) -> int:
        """How many of ``n`` units this rank holds."""
        return len(self.units(n))


SINGLE = TensorParallel()


@dataclass(frozen=True)
class StepChannel:
    """Rank 0 to every other rank, one pickled object at a time (gloo ``broadcast_object_list``)."""

    group: dist.ProcessGroup

    def send(self, obj: Any) -> None:
        dist.broadcast_object_list([obj], src=0, group=self.group)

    def receive(self) -> Any:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` in rank order, on rank 0 (None elsewhere)."""
        rank, size = dist.get_rank(self.group), dist.get_world_size(self.group)
        out = [None] * size if rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.group)
        return out


def rendezvous_store(size: int) -> dist.TCPStore:
    """Rank 0's rendezvous on 127.0.0.1 at a free port (``store.port``), before the other ranks exist."""
    return dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False, timeout=STORE_TIMEOUT)


def connect_store(port: int, size: int) -> dist.TCPStore:
    """A worker's connection to rank 0's rendezvous."""
    return dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=STORE_TIMEOUT)


def join_group(rank: int, size: int, store: dist.Store, device: torch.device,
               expert_parallel: bool) -> tuple[TensorParallel, StepChannel]:
    """Join the process groups (every rank calls this; it returns once all have).

    Rank 0 first waits until every other rank has checked in: a worker that dies before then leaves rank 0 waiting
    on the store (which its caller abandons harmlessly), not inside torch's group creation."""
    global _unfinished_join
    if dist.is_initialized():
        raise RuntimeError("a tensor-parallel engine already runs in this process; close() it before starting "
                           "another")
    if _unfinished_join:
        raise RuntimeError("an earlier tensor-parallel start-up in this process lost a worker while joining, which "
                           "leaves torch.distributed unusable here; start a new process")
    if rank == 0:
        store.wait([f"kvserve/ready/{r}" for r in range(1, size)])
    else:
        store.set(f"kvserve/ready/{rank}", "1")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    _unfinished_join = True
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=MODEL_GROUP_TIMEOUT)
    channel = StepChannel(dist.new_group(backend="gloo", timeout=CHANNEL_TIMEOUT))
    _unfinished_join = False
    return TensorParallel(rank, size, expert_parallel, dist.group.WORLD), channel


def leave_group() -> None:
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except RuntimeError:  # an aborted or broken group: nothing left to release cleanly
            pass


def abort_group() -> None:
    """Make NCCL collectives blocked on a dead peer fail now instead of at their timeout. (Gloo fails them by itself
    as soon as the peer's connection closes.)"""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        dist.distributed_c10d._abort_process_group()
