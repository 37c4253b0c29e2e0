"""The engine core: a scheduler (which alone owns the KV manager and the queues) and a model runner; `step()`
advances every running sequence once and returns token-level `SequenceOutput`s.

Text (detokenization, stop strings) is not made here: an `OutputProcessor` does it off the engine thread. With
async scheduling (`EngineConfig.async_scheduling`), `step()` schedules and launches step N+1 before it collects step
N's sampled tokens, so the host's work for one step overlaps the device's work for the previous one; the tokens are
the same either way. Single-threaded by design: one thread drives it (see engine/engine_loop.py).

With ``tensor_parallel_size`` N > 1 this process is rank 0: its runner holds rank 0's shard, and every step's
`SchedulerOutput` also goes to the N-1 worker processes (engine/parallel/workers.py) before rank 0 runs it.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from engine.config import EngineConfig, ModelConfig
from engine.errors import (
    FatalEngineError,
    KVCacheTooSmallError,
    PromptTooLongError,
    RequestRejected,
    WorkerDiedError,
)
from engine.model_runner import ModelRunner, StepPipeline
from engine.outputs import SchedulerStats, SequenceOutput
from engine.parallel.memory import RankMemory
from engine.parallel.workers import TensorParallelWorkers
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler


def _eos_ids(model_dir: Path, model_cfg: ModelConfig, tokenizer) -> set[int]:
    ids = set(model_cfg.eos_token_ids)
    gen = model_dir / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


class LLMEngine:
    def __init__(self, model_dir: Path, cfg: EngineConfig, model_id: str | None = None, tokenizer=None) -> None:
        from transformers import AutoTokenizer

        self.cfg = cfg
        self.model_dir = Path(model_dir)
        self.model_cfg = ModelConfig.from_dir(self.model_dir)
        self.max_model_len = min(cfg.max_model_len or self.model_cfg.max_position_embeddings,
                                 self.model_cfg.max_position_embeddings)
        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(str(self.model_dir))
        self.eos_token_ids = _eos_ids(self.model_dir, self.model_cfg, self.tokenizer)
        self.workers: TensorParallelWorkers | None = None
        if cfg.tensor_parallel_size > 1:
            self.runner, self.workers = TensorParallelWorkers.launch(self.model_dir, self.model_cfg, cfg,
                                                                     self.max_model_len)
        else:
            self.runner = ModelRunner(self.model_dir, self.model_cfg, cfg, self.max_model_len)
        self.scheduler = Scheduler(cfg, self.runner.num_blocks, model_id or str(self.model_dir), self.max_model_len,
                                   self.eos_token_ids)
        # async scheduling: the launched step whose tokens are not back yet waits in the pipeline
        self._pipeline = StepPipeline(bool(cfg.async_scheduling))

    # ---- requests ----------------------------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise `RequestRejected` for a request that could never run, before it takes any state."""
        if not prompt_token_ids:
            raise RequestRejected("the prompt is empty")
        vocab = self.model_cfg.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise RequestRejected(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if len(prompt_token_ids) >= self.max_model_len:
            over = len(prompt_token_ids) - self.max_model_len + 1
            raise PromptTooLongError(
                f"the prompt has {len(prompt_token_ids)} tokens; the context holds {self.max_model_len}, so it is "
                f"{over} token(s) too long (leaving room for one generated token)"
            )
        blocks = self.scheduler.blocks_needed(len(prompt_token_ids) + 1)
        if blocks > self.scheduler.num_blocks:
            raise KVCacheTooSmallError(
                f"the prompt needs {blocks} KV blocks but the cache has {self.scheduler.num_blocks}; "
                "give the engine more KV memory (num_kv_blocks / kv_cache_memory_gb)"
            )

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, cache_salt: str | None = None
    ) -> None:
        if request_id in self.scheduler.groups:
            raise RequestRejected(f"request id {request_id!r} is already in use")
        self.validate(prompt_token_ids, params)
        self.scheduler.add_request(request_id, prompt_token_ids, params, cache_salt)

    def abort_request(self, request_id: str, index: int | None = None) -> None:
        """Finish every sequence of the request (or only sequence ``index``) now; its blocks are free for the next
        step."""
        self.scheduler.abort(request_id, index)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._pipeline.in_flight is not None

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def num_cached_tokens(self, token_ids: list[int], cache_salt: str | None = None) -> int:
        return self.scheduler.num_cached_tokens(token_ids, cache_salt)

    @property
    def rank_memory(self) -> list[RankMemory]:
        """What each tensor-parallel rank holds (weights, KV pages); one entry without tensor parallelism."""
        return self.workers.rank_memory if self.workers is not None else [self.runner.memory]

    def watch_workers(self, on_death: Callable[[WorkerDiedError], None] | None) -> None:
        """Have ``on_death`` called (from a watcher thread) when a tensor-parallel worker dies, even while the
        engine is idle; None stops it. Without tensor parallelism there is nothing to watch."""
        if self.workers is not None:
            self.workers.on_death = on_death

    def close(self) -> None:
        """Release what outlives the engine thread: the tensor-parallel workers and their process group."""
        if self.workers is None:
            return
        if self._pipeline.in_flight is not None and self.workers.error is None:
            try:
                self._pipeline.in_flight.result()
            except Exception:  # noqa: BLE001 - closing anyway
                pass
        self._pipeline.in_flight = None
        self.workers.close()

    # ---- the step ----------------------------------------------------------------------------------------------
    def step(self) -> list[SequenceOutput]:
        sched = self.scheduler.schedule()
        try:
            if self.workers is not None:
                self.workers.send(sched)
            done = self._pipeline.push(self.runner.execute(sched), bool(sched.scheduled))
            output = done.result() if done is not None else None
        except Exception as exc:
            if self.workers is not None:  # the ranks are out of step now: no later step could run
                self.workers.raise_if_dead(exc)  # a dead worker broke the step: its own error
                raise FatalEngineError(f"a tensor-parallel step failed on rank 0: {exc!r}") from exc
            raise
        if output is not None:
            self.scheduler.update(output)
        return self.scheduler.take_outputs()

