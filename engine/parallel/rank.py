"""A tensor-parallel rank process: ranks 1..N-1, each in its own process, started by rank 0 (`engine.parallel.ranks`).

A rank builds its runner (its shard of the weights, its shard of every KV block) and then applies every
`SchedulerOutput` rank 0 sends, in order, exactly as rank 0's runner does, until rank 0 sends None. It never
schedules, samples or detokenizes: it runs its part of each forward pass and receives the sampled ids from rank 0.
An error is written to rank 0 through ``errors`` before the rank exits non-zero; a rank whose rank 0 is gone
exits at once.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from engine.config import EngineConfig, ModelConfig
from engine.worker.model_runner import ModelRunner, StepPipeline
from engine.parallel.memory import RankMemory
from engine.parallel.sizes import rank_device
from engine.parallel.state import StepChannel, connect_store, join_group, leave_group
from engine.core.processes import exit_with_parent


@dataclass(frozen=True)
class RankSpec:
    """What every rank needs to build its runner (pickled into the spawned process)."""

    model_dir: Path
    model_cfg: ModelConfig
    cfg: EngineConfig  # rank 0's; each rank derives its own device from it
    max_model_len: int
    store_port: int  # rank 0's rendezvous on 127.0.0.1


def rank_config(cfg: EngineConfig, rank: int) -> EngineConfig:
    return dataclasses.replace(cfg, device=rank_device(cfg.device, rank))


def join(rank: int, spec: RankSpec, store) -> tuple[ModelRunner, StepChannel, list[RankMemory] | None]:
    """Join the group and build this rank's runner; rank 0 also gets every rank's memory report."""
    cfg = rank_config(spec.cfg, rank)
    size = spec.cfg.tensor_parallel_size
    tp, channel = join_group(rank, size, store, torch.device(cfg.device), cfg.enable_expert_parallel)
    runner = ModelRunner(spec.model_dir, spec.model_cfg, cfg, spec.max_model_len, tp)
    return runner, channel, channel.gather(runner.memory)


def run_rank(rank: int, spec: RankSpec, errors: Connection) -> None:
    """The rank process's entry point (torch.multiprocessing, spawn)."""
    # Ctrl-C (and a service manager's SIGTERM) reach every process of the group: rank 0 drains, then stops us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    exit_with_parent()
    if spec.cfg.device == "cpu":  # the ranks share the cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.cfg.tensor_parallel_size))
    try:
        runner, channel, _ = join(rank, spec, connect_store(spec.store_port, spec.cfg.tensor_parallel_size))
        _serve_steps(runner, channel)
    except BaseException:  # noqa: BLE001 - rank 0 reports it as this rank's death
        errors.send(traceback.format_exc())
        errors.close()
        os._exit(1)  # the process group may be unusable; do not wait on it
    leave_group()


def _serve_steps(runner: ModelRunner, channel: StepChannel) -> None:
    pipeline = StepPipeline(bool(runner.cfg.async_scheduling))
    while (sched := channel.receive()) is not None:
        if sched.drafts:
            # Speculative decoding: drafts continue the rows' known tokens, and the step's emitted tokens are
            # several per row (not the one id the next step's inputs can read on the device): as on rank 0, the
            # step before is collected first and this one before the next.
            if pipeline.in_flight is not None:
                pipeline.in_flight.result()
                pipeline.in_flight = None
            runner.execute(sched).result()
            continue
        done = pipeline.push(runner.execute(sched), bool(sched.num_scheduled))
        if done is not None:
            done.result()  # the sampled ids reach this rank's host copy of the sequences
    if pipeline.in_flight is not None:
        pipeline.in_flight.result()
