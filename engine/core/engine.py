"""The engine core: a scheduler (which alone owns the KV manager and the queues) and a model runner; `step()`
advances every running sequence once and returns the step's token-level outputs as one `StepOutputs`. Requests
arrive prepared (validated, their block hashes made: engine/requests.py) by whoever submits them.

Text (detokenization, stop strings) is not made here: an `OutputProcessor` does it off the engine thread. With
async scheduling (`EngineConfig.async_scheduling`), `step()` schedules and launches step N+1 before it collects step
N's sampled tokens, so the host's work for one step overlaps the device's work for the previous one; the tokens are
the same either way. A grammar-constrained sequence's next mask needs its last token, so a step that sampled one is
collected before the next is scheduled. Single-threaded by design: one thread drives it (see engine/core/loop.py).

With ``tensor_parallel_size`` N > 1 this process is rank 0: its runner holds rank 0's shard, and every step's
`SchedulerOutput` also goes to the N-1 worker processes (engine/parallel/ranks.py) before rank 0 runs it.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

from engine.config import DEFAULT_BLOCK_SIZE, EngineConfig, ModelConfig
from engine.kv.block_hashing import BlockHasher
from engine.errors import FatalEngineError, RequestRejected, WorkerDiedError
from engine.kv.blocks import CacheStats
from engine.kv.events import KVEventPublisher
from engine.kv.window_pool import WindowBudget
from engine.models.vision.preprocess import ImagePreprocessor
from engine.worker.forced_tokens import force_tokens
from engine.worker.model_runner import ModelRunner, StepHandle, StepPipeline
from engine.outputs import KVTransfer, SchedulerOutput, SchedulerStats, StepOutputs
from engine.parallel.memory import RankMemory
from engine.parallel.ranks import TensorParallelRanks
from engine.multimodal import ImageInput
from engine.requests import EngineRequest, RequestPreparer
from engine.retention import Retention
from engine.sampling_params import SamplingParams
from engine.sched.scheduler import Scheduler
from engine.worker.structured_output import GrammarEnd, StructuredOutputs

log = logging.getLogger(__name__)


def _eos_ids(model_dir: Path, model_cfg: ModelConfig, tokenizer) -> set[int]:
    ids = set(model_cfg.eos_token_ids)
    gen = model_dir / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def _speculation_refused(model_cfg: ModelConfig, cfg: EngineConfig) -> str | None:
    """Why this engine cannot speculate (None: it can)."""
    if model_cfg.v4 is not None:
        return "DeepSeek-V4 cannot speculate yet: its compressors' pooling state would see rejected drafts"
    return None


class LLMEngine:
    """``clock`` is the time the KV cache's retention (pins, session holds) runs on: a benchmark that replays a
    trace in virtual time passes its own."""

    def __init__(self, model_dir: Path, cfg: EngineConfig, model_id: str | None = None, tokenizer=None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        from engine.text.tokenizer_load import load_tokenizer

        self.model_dir = Path(model_dir)
        self.model_cfg = ModelConfig.from_dir(self.model_dir)
        if cfg.block_size is None:
            cfg = dataclasses.replace(cfg, block_size=self.model_cfg.choose_block_size(None))
            if cfg.block_size != DEFAULT_BLOCK_SIZE:
                log.info("block size %d: the least this model accepts (it keeps pools of %d tokens per block)",
                         cfg.block_size, self.model_cfg.block_multiple)
        self.cfg = cfg
        self.speculation_refused = _speculation_refused(self.model_cfg, cfg)
        if self.speculation_refused and cfg.speculative != "off":
            raise ValueError(f"--speculative {cfg.speculative}: {self.speculation_refused}")
        if cfg.speculative == "mtp" and not self.model_cfg.num_mtp_layers:
            raise ValueError("--speculative mtp: this checkpoint has no multi-token-prediction layer (Qwen3.5 / 3.6 "
                             "and Qwen3-Next carry one as mtp.*, DeepSeek-V3 / R1 / V3.2 as the layer after the last, "
                             "num_nextn_predict_layers in config.json); use ngram or suffix")
        if cfg.speculative != "mtp":  # the MTP layer is built and loaded only to draft with it
            self.model_cfg = dataclasses.replace(self.model_cfg, num_mtp_layers=0)
        self.max_model_len = min(cfg.max_model_len or self.model_cfg.max_position_embeddings,
                                 self.model_cfg.max_position_embeddings)
        # a copy of this process's earlier load of these files, if any (engine/text/tokenizer_load.py)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(self.model_dir)
        self.eos_token_ids = _eos_ids(self.model_dir, self.model_cfg, self.tokenizer)
        self.workers: TensorParallelRanks | None = None
        if cfg.tensor_parallel_size > 1:
            self.runner, self.workers = TensorParallelRanks.launch(self.model_dir, self.model_cfg, cfg,
                                                                     self.max_model_len)
        else:
            self.runner = ModelRunner(self.model_dir, self.model_cfg, cfg, self.max_model_len)
        self.kv_events = (KVEventPublisher(cfg.kv_events_endpoint, cfg.kv_events_replay_endpoint, cfg.kv_events_topic,
                                           cfg.block_size, all_interfaces=cfg.kv_events_all_interfaces,
                                           token_ids=cfg.kv_events_token_ids) if cfg.kv_events_endpoint else None)
        self.hasher = BlockHasher(cfg.block_size, model_id or str(self.model_dir))  # the one the engine hashes with
        layout = self.runner.kv_layout()
        self.scheduler = Scheduler(cfg, layout, self.hasher, self.max_model_len, self.eos_token_ids,
                                   record_events=self.kv_events is not None, clock=clock)
        mtp = self.model_cfg.num_mtp_layers > 0
        # a sliding-window model: what one sequence's step may take of its window pool (no window model drafts with
        # MTP: DeepSeek V4 cannot speculate, `speculation_refused`)
        self.window_budget = (WindowBudget(layout.window, cfg.block_size, layout.window_blocks,
                                           cfg.max_num_batched_tokens) if layout.window_blocks else None)
        self.preparer = RequestPreparer(
            self.model_cfg.vocab_size, self.max_model_len, cfg.block_size, self.runner.num_blocks,
            self.hasher if cfg.enable_prefix_caching else None,
            self.speculation_refused, mtp=mtp, image_token_id=self.image_token_id, window_budget=self.window_budget)
        self.structured_outputs = StructuredOutputs(self.tokenizer, self.model_cfg.vocab_size, self.eos_token_ids,
                                                    self.runner.device, cfg.json_whitespace)
        offload = self.runner.kv_offload
        if offload and offload.disk:  # blocks a previous run left on disk
            self.scheduler.load_disk_tier(offload.read_disk_block, ((b.block_hash, b.token_ids, b.parent_hash,
                                                                     b.has_state) for b in offload.disk.scan()))
            self._run_transfers(self.scheduler.take_transfers())  # deletes what no longer fits
            self._publish_events()
        # async scheduling: the launched step whose tokens are not back yet waits in the pipeline
        self._pipeline = StepPipeline(bool(cfg.async_scheduling))
        self._in_flight_constrained = False  # ... and whether it sampled for a grammar-constrained sequence
        self._closed = False

    # ---- requests ----------------------------------------------------------------------------------------------
    def prepare(self, request: EngineRequest) -> EngineRequest:
        """Validate ``request`` and make its block hashes (`RequestPreparer.prepare`; any thread)."""
        return self.preparer.prepare(request)

    def add(self, request: EngineRequest) -> None:
        """Queue a request (prepared here if its submitter did not). `RequestRejected`: its id is in use, its
        grammar does not compile, or (unprepared) it could never run."""
        if request.request_id in self.scheduler.requests:
            raise RequestRejected(f"request id {request.request_id!r} is already in use")
        if not request.prepared:
            self.preparer.prepare(request)
        if request.params.structured_output is not None:
            try:
                self.structured_outputs.compile(request.params.structured_output)  # cached: compiled before
            except ValueError as exc:
                raise RequestRejected(str(exc)) from None
        self.scheduler.add_request(request.request_id, request.prompt_token_ids, request.params, request.cache_salt,
                                   request.retention, request.block_hashes, request.images)

    @functools.cached_property
    def image_preprocessor(self) -> ImagePreprocessor:
        """The model's image processor (its preprocessor_config.json), with the decoding limits."""
        return ImagePreprocessor.from_model_dir(self.model_dir)

    @property
    def image_token_id(self) -> int | None:
        """The placeholder token of images, where the model's vision tower is loaded (else None: text only)."""
        vision = self.runner.vision
        return None if vision is None else vision.image_token_id

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, cache_salt: str | None = None,
        retention: Retention | None = None,
    ) -> None:
        self.add(EngineRequest(request_id, prompt_token_ids, params, cache_salt, retention))

    def abort_request(self, request_id: str, index: int | None = None) -> None:
        """Finish every sequence of the request (or only sequence ``index``) now; its blocks are free for the next
        step."""
        self.scheduler.abort(request_id, index)
        self.structured_outputs.retain(self.scheduler.sequences)

    def has_request(self, request_id: str) -> bool:
        """Whether a sequence of the request is still queued or running."""
        return request_id in self.scheduler.requests

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._pipeline.in_flight is not None

    def stats(self) -> SchedulerStats:
        masks = self.structured_outputs.stats
        stats = dataclasses.replace(self.scheduler.stats(), grammar_mask_steps=masks.steps,
                                    grammar_mask_wait_seconds=masks.wait_s)
        offload = self.runner.kv_offload
        if offload is None:
            return stats
        moved = offload.stats
        if offload.on_cuda:
            moved.settle()
        return dataclasses.replace(stats, kv_offload_bytes=moved.offload_bytes, kv_restore_bytes=moved.restore_bytes,
                                   kv_disk_write_bytes=moved.disk_write_bytes, kv_disk_read_bytes=moved.disk_read_bytes,
                                   kv_restore_seconds=moved.restore_s)

    def settle_hold(self, request_id: str, keep_s: float) -> int:
        """The caller's word on a finished request it submitted with a hold (`Retention.hold_after_finish_s`, held
        until this word at most that long): keep its blocks ``keep_s`` more seconds (its reply ended in tool calls,
        and the turn that carries the result will read them), or 0: release them now. Returns the blocks kept."""
        return self.scheduler.retain_finished(request_id, keep_s)

    def pin(self, token_ids: list[int], cache_salt: str | None, ttl_s: float) -> int:
        """Pin the cached blocks of a prompt for ``ttl_s`` seconds, renewed on every hit (0: unpin); returns how many
        of its blocks the device holds."""
        hashes = self.preparer.hasher.hashes(token_ids, cache_salt) if self.preparer.hasher else []
        return self.scheduler.pin(hashes, ttl_s)

    @property
    def cache_stats(self) -> CacheStats:
        """Prefix-cache counters: queries and hits in tokens (preempted re-admissions apart), evictions."""
        return self.scheduler.cache_stats()

    def reset_prefix_cache(self) -> None:
        """Drop every cached block no sequence holds, in every tier (between benchmark runs)."""
        self.scheduler.reset_prefix_cache()
        self._run_transfers(self.scheduler.take_transfers())
        self._publish_events()

    def _run_transfers(self, transfers: list[KVTransfer]) -> None:
        """Copies between KV tiers outside a step, on every rank (each holds its shard of every block)."""
        if transfers and self.workers is not None:
            self.workers.send(SchedulerOutput(kv_transfers=transfers))
        self.runner.run_transfers(transfers)

    def _publish_events(self) -> None:
        if self.kv_events is not None:
            self.kv_events.publish(self.scheduler.take_kv_events())

    def close(self) -> None:
        """Release what outlives the engine thread: write the device-cached blocks through to the disk tier (if
        there is one) and finish its writes, stop the event publisher and the tensor-parallel workers. Call it once
        the engine stopped stepping; later calls do nothing."""
        if self._closed:
            return
        self._closed = True
        in_flight, self._pipeline.in_flight = self._pipeline.in_flight, None
        if in_flight is not None and (self.workers is None or self.workers.error is None):
            try:
                in_flight.result()
            except Exception:  # noqa: BLE001 - closing anyway
                pass
        offload = self.runner.kv_offload
        if offload is not None:
            if offload.disk is not None:
                self.scheduler.persist()
                self._run_transfers(self.scheduler.take_transfers())
                self._publish_events()
            offload.close()
        if self.kv_events is not None:
            self.kv_events.close()
        self.structured_outputs.close()
        if self.workers is not None:
            self.workers.close()

    def num_cached_tokens(self, token_ids: list[int], cache_salt: str | None = None,
                          images: tuple[ImageInput, ...] = ()) -> int:
        return self.scheduler.num_cached_tokens(token_ids, cache_salt, images)

    @property
    def rank_memory(self) -> list[RankMemory]:
        """What each tensor-parallel rank holds (weights, KV blocks); one entry without tensor parallelism."""
        return self.workers.rank_memory if self.workers is not None else [self.runner.memory]

    def watch_workers(self, on_death: Callable[[WorkerDiedError], None] | None) -> None:
        """Have ``on_death`` called (from a watcher thread) when a tensor-parallel worker dies, even while the
        engine is idle; None stops it. Without tensor parallelism there is nothing to watch."""
        if self.workers is not None:
            self.workers.on_death = on_death

    # ---- the step ----------------------------------------------------------------------------------------------
    def step(self) -> StepOutputs:
        try:
            pipeline = self._pipeline
            # Grammars need the tokens in flight for the next masks; proposers need them to draft after.
            if pipeline.in_flight is not None and (self._in_flight_constrained or self.scheduler.num_speculative):
                self._collect(pipeline.in_flight)
                pipeline.in_flight = None
            sched = self.scheduler.schedule()
            if self.workers is not None:
                self.workers.send(sched)
            masks = self._start_masks(sched)
            forced, phases_open = self._forced_tokens(sched)
            processor = masks if forced is None else forced if masks is None else _chain(masks, forced)
            done = pipeline.push(self.runner.execute(sched, processor), bool(sched.num_scheduled))
            self._in_flight_constrained = masks is not None or phases_open
            if done is not None:
                self._collect(done)
        except Exception as exc:
            if self.workers is not None:  # the ranks are out of step now: no later step could run
                self.workers.raise_if_dead(exc)  # a dead worker broke the step: its own error
                raise FatalEngineError(f"a tensor-parallel step failed on rank 0: {exc!r}") from exc
            raise
        self._publish_events()
        return self.scheduler.take_outputs()

    def _start_masks(self, sched: SchedulerOutput):
        """Start filling the grammar masks of this step's constrained samples (beside the forward pass), one per
        position a drafting row verifies; returns what the runner calls on the logits, or None when nothing sampled
        here is constrained."""
        if not self.scheduler.num_constrained:
            return None
        sequences = self.scheduler.sequences
        rows = [(seq_id, sequences[seq_id]) for seq_id, samples in zip(sched.seq_ids, sched.samples) if samples]
        pending = self.structured_outputs.start_masks([seq for _, seq in rows],
                                                      [sched.drafts.get(seq_id, ()) for seq_id, _ in rows])
        if pending is None:
            return None
        return lambda logits, seq_ids, counts: self.structured_outputs.apply_masks(pending, logits, seq_ids, counts)

    def _forced_tokens(self, sched: SchedulerOutput) -> tuple[Callable | None, bool]:
        """The tokens this step's samples must be, of sequences whose phase budget is spent (engine/phase_budget.py),
        as a logits processor (None: nothing forced); and whether any sampled here has a phase that is not over, so
        that its tokens come back before the next step is scheduled (the next forced token depends on them)."""
        if not self.scheduler.num_budgeted:
            return None, False
        sequences, forced, phases_open = self.scheduler.sequences, {}, False
        for seq_id, samples in zip(sched.seq_ids, sched.samples):
            phase = sequences[seq_id].phase
            if samples and phase is not None:
                phase.advance(sequences[seq_id].token_ids)
                token = phase.forced_token()
                if token is not None:
                    forced[seq_id] = token
                phases_open |= phase.active
        return (force_tokens(forced) if forced else None), phases_open

    def _collect(self, handle: StepHandle) -> None:
        out = handle.result()
        if not self.structured_outputs.num_active:  # nothing sampled under a grammar (its masks made matchers)
            self.scheduler.update(out)
            return
        sequences = self.scheduler.sequences
        emitted = out.emitted()
        live = [(sequences[s], tokens) for s, tokens in zip(out.seq_ids, emitted) if s in sequences]
        ends = self.structured_outputs.accept([r for r, _ in live], [t for _, t in live])
        failed = {GrammarEnd.REJECTED: lambda seq, tokens: f"token {tokens[0]} is outside the grammar",
                  GrammarEnd.FAILED: lambda seq, tokens: self.structured_outputs.failure(seq.seq_id)}
        grammar_ends = {
            seq.seq_id: failed[end](seq, tokens[used:]) if end in failed else None
            for (seq, tokens), (end, used) in zip(live, ends) if end is not None
        }
        if out.emitted_token_ids is not None:  # nothing may follow a whole output: its step's tokens end there
            used = {seq.seq_id: n for (seq, _), (_, n) in zip(live, ends)}
            out = dataclasses.replace(out, emitted_token_ids=[
                tokens[:used[s]] if s in used and s in grammar_ends else tokens
                for s, tokens in zip(out.seq_ids, out.emitted_token_ids)])
        self.scheduler.update(out, grammar_ends)
        self.structured_outputs.retain(sequences)


def _chain(*processors: Callable) -> Callable:
    """Logits processors applied in turn (a grammar's masks, then forced tokens)."""
    def apply(logits, seq_ids, counts) -> None:
        for processor in processors:
            processor(logits, seq_ids, counts)
    return apply
