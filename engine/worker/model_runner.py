"""Owns the model weights, the K/V block tensors and the runner's view of the sequences; turns each
`SchedulerOutput` into one flattened forward pass plus sampling.

`execute()` applies the step's deltas to the persistent `InputBatch`, flattens the scheduled rows with numpy, ships
them with one host-to-device copy, launches the forward and the sampler, and starts copying the sampled ids back;
it returns a `StepHandle` at once. `StepHandle.result()` waits for that copy (the step's one sync) and returns the
`ModelRunnerOutput`. On a GPU the engine schedules and prepares the next step in between (async scheduling): the
next step's decode inputs read the sampled ids straight from the device.

Under tensor parallelism every rank has a runner for its shard and applies the same `SchedulerOutput`s (rank 0
sends them, engine/parallel/). Sampling happens on rank 0 only: the vocab-parallel head gathers the logits there,
rank 0 samples (penalties, seeded generators and logprobs live there alone) and broadcasts the ids, which every
rank needs for the next step's inputs. The ranks' tokens are therefore identical by construction.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from engine.config import EngineConfig, ModelConfig
from engine.worker.cuda_graphs import DecodeGraphRunner, KVCaches
from engine.worker.input_batch import InputBatch, RunnerSequence
from engine.worker.kv_disk import DiskStore
from engine.kv.layout import KVLayout
from engine.kv.window_pool import pages_per_window
from engine.worker.kv_offload import KVOffload, flat_caches, row_bytes, state_row_shape
from engine.models.architectures import build_model, random_weights_
from engine.outputs import KVTransfer, ModelRunnerOutput, NewSequence, SchedulerOutput, StateCopy
from engine.parallel.memory import RankMemory, measure
from engine.parallel.state import SINGLE, TensorParallel
from engine.worker.prompt_logprobs import PromptScoring, PromptSpan, ScoredSpan, score_spans
from engine.worker.sampler import Penalties, SamplerOutput, SamplingBatch, has_penalties, make_generator, penalty_parameters, sample
from engine.sampling_params import SamplingParams
from engine.spec.mtp import MTPDrafter
from engine.spec.verify import verify
from engine.worker.step_inputs import DeviceInputs, HostInputs, flatten
from engine.worker.vision_inputs import StepImages, VisionInputs
from engine.multimodal import ImageInput
from engine.models.vision.towers import load_vision_tower
from engine.models.layers.mxfp4_experts import keep_experts_packed, use_mxfp4_experts
from engine.weights import load_weights, use_fp8_layers
from kernels.cpu.linear import pack_linears
from kernels.ops import fp8_gemm_supported, get_ops
from kernels.attention_metadata import AttentionMetadata, StateBatch

log = logging.getLogger(__name__)
# (logits [rows, vocab] changed in place, the seq ids they sample for, rows per seq id: 1 + its drafts, or None: 1)
LogitsProcessor = Callable[[torch.Tensor, list[str], list[int] | None], None]

# The sampler's most expensive path (penalties, top-p over the full vocabulary, min-p, logprobs): what the memory
# profile samples with.
_PROFILE_PARAMS = SamplingParams(temperature=1.0, top_p=0.9, min_p=0.05, repetition_penalty=1.1, presence_penalty=0.5,
                                 frequency_penalty=0.5, logprobs=20)


@dataclass
class StepProfile:
    """Where the steps' time went, in seconds, summed (for `kvserve bench step`)."""

    prepare_s: float = 0.0  # host: deltas, flattening, sampling parameters
    launch_s: float = 0.0  # the device part (upload, forward, sampling): compute on CPU, kernel launches on CUDA
    launch_cpu_s: float = 0.0  # the same, in CPU time of the thread that ran it (robust to a busy machine)
    wait_s: float = 0.0  # host blocked in `result()` until the step's sampled ids are there
    device_s: float = 0.0  # CUDA only, with `ModelRunner.time_device`: the device part's GPU time (events)


@dataclass
class _DeviceWork:
    """The device part of one step, prepared on the host."""

    host: HostInputs
    pad_to: int | None  # run the decode graph of this size
    sampling: SamplingBatch | None  # None: nothing samples this step, or another rank samples
    sampled: list[RunnerSequence]  # the sequences of the sampled rows, in order (rank 0)
    seq_ids: list[str]  # of the sampled rows, in order
    logits_processor: LogitsProcessor | None  # e.g. grammar masks, applied to the logits before sampling
    transfers: list[KVTransfer] = field(default_factory=list)  # copies between KV tiers, before the forward
    prompt_spans: list[PromptSpan] = field(default_factory=list)  # rows that score prompt tokens
    state_restores: list[StateCopy] = field(default_factory=list)  # hybrid models: snapshot -> slot, before it
    state_snapshots: list[StateCopy] = field(default_factory=list)  # ... slot -> snapshot, after it
    drafts: list[list[int]] | None = None  # speculative decoding: per sampled row its drafts (None: no row drafts)
    images: StepImages | None = None  # the step's image tokens (a vision-language model's sequences with images)
    encode_images: list[ImageInput] = field(default_factory=list)  # into the encoder cache, before the forward


@dataclass
class _Launched:
    sampled: SamplerOutput | None  # on the host (pinned) on CUDA
    scored: list[ScoredSpan] = field(default_factory=list)  # prompt logprobs, likewise
    done: torch.cuda.Event | None = None
    started: torch.cuda.Event | None = None


@dataclass
class StepHandle:
    """A launched step; `result()` waits for its sampled ids (the step's one sync) and returns them."""

    runner: "ModelRunner"
    seq_ids: list[str] = field(default_factory=list)
    rows: np.ndarray | None = None  # the sampled sequences' batch rows when the step was prepared ...
    batch_version: int = -1  # ... valid while the batch keeps this version
    params: list[SamplingParams] = field(default_factory=list)
    launched: _Launched | Future | None = None
    _output: ModelRunnerOutput | None = None

    def result(self) -> ModelRunnerOutput:
        if self._output is not None:
            return self._output
        start = time.perf_counter()
        launched = self.launched.result() if isinstance(self.launched, Future) else self.launched
        if launched is not None and launched.done is not None:
            launched.done.synchronize()
        profile = self.runner.profile
        profile.wait_s += time.perf_counter() - start
        if launched is None or (launched.sampled is None and not launched.scored):
            self._output = ModelRunnerOutput([], [])
            return self._output
        if launched.started is not None:
            profile.device_s += launched.started.elapsed_time(launched.done) / 1e3
        token_ids, logprobs = [], None
        emitted = drafts = None
        if launched.sampled is not None:
            token_ids, logprobs = launched.sampled.on_host(self.params)
            emitted, drafts = launched.sampled.emitted, launched.sampled.drafts
            self.runner.record_sampled(self, token_ids, emitted)
        scored = [(s.seq_id, s.first_token, s.entries()) for s in launched.scored]
        self._output = ModelRunnerOutput(self.seq_ids if len(token_ids) else [], token_ids, logprobs, scored, emitted,
                                         drafts)
        return self._output


@dataclass
class StepPipeline:
    """Which launched step to collect now: with async scheduling the one before (its tokens come back while the
    step just launched runs), else the one just launched. Rank 0's engine and every worker step through one."""

    overlap: bool
    in_flight: StepHandle | None = None

    def push(self, handle: StepHandle, scheduled: bool) -> StepHandle | None:
        if not self.overlap:
            return handle
        done, self.in_flight = self.in_flight, (handle if scheduled else None)
        return done


class ModelRunner:
    """One rank's runner (the only one without tensor parallelism); ``cfg.device`` is this rank's device."""

    def __init__(self, model_dir: Path, model_cfg: ModelConfig, cfg: EngineConfig, max_model_len: int,
                 tp: TensorParallel = SINGLE) -> None:
        self.cfg = cfg
        self.model_cfg = model_cfg
        self.max_model_len = max_model_len
        self.tp = tp
        self.device = torch.device(cfg.device)
        self.dtype = cfg.torch_dtype
        torch.manual_seed(cfg.seed)
        if self.device.type == "cuda":
            _use_expandable_segments()
        fp8_layers = fp8_gemm_supported(cfg.attention_backend, self.device) and cfg.load_format != "dummy"
        packed_experts = keep_experts_packed(cfg.mxfp4_experts, cfg.attention_backend, model_dir)

        def on_meta(model: nn.Module) -> None:  # quantized layers swapped in before any memory is allocated
            if fp8_layers:
                use_fp8_layers(model, model_dir)
            if packed_experts:
                use_mxfp4_experts(model)

        model = build_model(model_cfg, get_ops(cfg.attention_backend), self.device, self.dtype, max_model_len,
                            on_meta=on_meta, tp=tp)
        if cfg.load_format == "dummy":
            random_weights_(model, cfg.seed)
        else:
            load_weights(model, model_dir, progress=tp.is_first)
        if self.device.type == "cpu" and cfg.attention_backend == "cpu":
            pack_linears(model)  # the native CPU op set: weights packed once, not by MKL on every call
        self.model = model.eval()
        # a vision-language checkpoint's tower (not with --language-model-only). Under tensor parallelism every rank
        # holds the whole tower and encodes every image (its output replaces embeddings after their all-reduce, so
        # each rank needs all of it; the tower is small beside the language model's shard)
        self.vision = self._load_vision(model_dir) if model_cfg.has_vision_tower else None
        self.kv_spec = model.kv_cache_spec()
        recurrent = self.kv_spec.recurrent is not None
        # sliding-window models: the window layers' pages in a group of their own (engine/kv/window_pool.py)
        self.window_group = cfg.sliding_window_cache and self.kv_spec.window > 0
        rows = cfg.max_num_seqs
        self.max_blocks_per_row = -(-max_model_len // cfg.block_size)
        self.inputs = DeviceInputs(max(cfg.max_num_batched_tokens, rows), rows, self.max_blocks_per_row, self.device,
                                   recurrent, self.window_group)
        self.batch = InputBatch(rows, max_model_len, self.max_blocks_per_row, self.window_group)
        self.sequences: dict[str, RunnerSequence] = {}
        self.scoring = PromptScoring()
        self.profile = StepProfile()
        self.time_device = False  # CUDA: time each step's kernels with events (benchmarks)
        self._prev_sampled: torch.Tensor | None = None  # the last launched step's sampled ids, on the device
        # The sampled rows' sampler view and sequences, rebuilt only when the set of sampling sequences changes ...
        self._sampling_batch: tuple[tuple, SamplingBatch, list[RunnerSequence]] | None = None
        # ... and its penalties (device thread), with the sequences whose output counts are rows of them
        self._penalties: tuple[SamplingBatch, Penalties, list[RunnerSequence]] | None = None
        # Async scheduling on CPU: the device part of each step runs in order on this thread (as kernels run in
        # order on a CUDA stream), so the host prepares the next step meanwhile; torch releases the GIL while it
        # computes. On CUDA the kernels are asynchronous already.
        self._device_thread = (ThreadPoolExecutor(1, thread_name_prefix="kvserve-device")
                               if cfg.async_scheduling and self.device.type != "cuda" else None)
        # Graphs need kernels without host syncs: the Triton ops (the torch reference reads lengths on the host).
        # Under tensor parallelism decode runs eagerly: capturing the NCCL collectives is not verified yet.
        # Hybrid models too: the Triton recurrent kernels index state rows on the device (padding rows: slot -1).
        use_graphs = (self.device.type == "cuda" and cfg.attention_backend == "triton" and not cfg.enforce_eager
                      and tp.size == 1 and getattr(model, "cuda_graphs", True))
        # Every rank holds its shard of every block, so all ranks agree on the pool: the smallest that fits.
        blocks, snapshots = self._size_cache(use_graphs)
        self.num_blocks = tp.min(blocks, self.device)
        self.num_window_blocks = tp.min(self._num_window_blocks, self.device) if self.window_group else 0
        # Hybrid models: a recurrent-state row per running sequence, and the snapshots' (engine.kv.state_pool);
        # after them, outside the pool, one per draft token a step may verify: the state after each verified
        # position, so the one after the last accepted draft is kept (`_keep_accepted_states`)
        self.num_state_rows = cfg.max_num_seqs + tp.min(snapshots, self.device) if recurrent else 0
        self.num_draft_states = self._num_draft_states()
        self.kv_caches = self._new_caches(self.num_blocks, self.num_state_rows + self.num_draft_states)
        self.memory: RankMemory = measure(tp.rank, self.model, self.kv_caches)
        self.kv_offload = self._new_offload(model_dir) if cfg.kv_offload_gb else None
        self.decode_graphs: DecodeGraphRunner | None = None
        if use_graphs:
            self.decode_graphs = self._capture_decode_graphs()
        # --speculative mtp: the model's MTP layer drafts after every step (engine/spec/mtp.py)
        self.mtp_drafter = (MTPDrafter(model, cfg.num_speculative_tokens, cfg.block_size, max_model_len)
                            if getattr(model, "mtp", None) is not None else None)

    def kv_layout(self) -> KVLayout:
        """What this runner allocated, for the KV manager: the device pool and both halves of each lower tier."""
        offload, cfg = self.kv_offload, self.cfg
        host_states = offload.host_states[0].shape[0] if offload and offload.host_states else 0
        disk_blocks, disk_states = (offload.disk_capacity(cfg.kv_disk_gb, self._tier_row_fraction())
                                    if offload and offload.disk else (0, 0))
        return KVLayout(self.num_blocks, self.num_state_rows, self.num_window_blocks, self.kv_spec.window,
                        offload.host_tensors[0].shape[0] if offload else 0, host_states, disk_blocks, disk_states)

    def _load_vision(self, model_dir: Path) -> VisionInputs | None:
        if self.cfg.language_model_only or self.cfg.load_format == "dummy":
            return None
        tower = load_vision_tower(model_dir, self.device, self.dtype)
        if tower is None:
            return None
        return VisionInputs(tower, int(self.cfg.encoder_cache_mb * 2**20), self.model.rope_dim, self.device)

    def _num_draft_states(self) -> int:
        """Hybrid models that may speculate: a step verifies at most ``speculative_draft_budget`` drafts."""
        return self.cfg.speculative_draft_budget if self.kv_spec.recurrent is not None else 0

    def _new_caches(self, num_blocks: int, num_state_rows: int, num_window_blocks: int | None = None) -> KVCaches:
        return self.kv_spec.allocate(num_blocks, self.cfg.block_size, self.cfg.kv_cache_torch_dtype, self.device,
                                     num_state_rows, self.dtype,
                                     self.num_window_blocks if num_window_blocks is None else num_window_blocks)

    def _new_offload(self, model_dir: Path) -> KVOffload:
        """The host pool (and disk tier) for blocks evicted from the device pool, and their rows for a hybrid
        model's snapshots or a sliding-window model's retained windows (`_tier_row_fraction` of the memory)."""
        spec, cfg = self.kv_spec, self.cfg
        pages = spec.block_layers(self.kv_caches, self.window_group)
        per_row = 0  # a window row: the pages a resume reads (docs/SLIDING_WINDOW.md)
        if self.window_group:
            states = spec.window_layers(self.kv_caches)  # (DeepSeek V4: its keys, not its compressed entries)
            per_row = pages_per_window(spec.window, cfg.block_size)
        else:
            states = spec.state_layers(self.kv_caches) if spec.recurrent is not None else []
        tensors, state_tensors = flat_caches(pages), flat_caches(states)
        state_bytes = row_bytes(state_tensors) * max(1, per_row)
        disk = None
        if cfg.kv_disk_dir:
            layout = {"model": str(Path(model_dir).resolve()), "block_size": cfg.block_size,
                      "dtype": str(tensors[0].dtype), "shapes": [list(t.shape[1:]) for t in tensors]}
            if state_tensors:  # a file may end with its block's snapshot (or window)
                layout["state_shapes"] = [[str(t.dtype), *state_row_shape(t, per_row)] for t in state_tensors]
            disk = DiskStore(cfg.kv_disk_dir, layout, row_bytes(tensors) + state_bytes)
        blocks, rows = KVOffload.tier_capacity(cfg.kv_offload_gb, row_bytes(tensors), state_bytes,
                                               self._tier_row_fraction())
        return KVOffload(pages, blocks, disk, states, rows, per_row)

    def _tier_row_fraction(self) -> float:
        """The share of a tier's memory its rows take, as on the device: a hybrid's snapshots
        ``state_snapshot_fraction``, a window model's retained windows ``window_retention_fraction``."""
        return self.cfg.window_retention_fraction if self.window_group else self.cfg.state_snapshot_fraction

    def make_decode_graphs(self, kv_caches: KVCaches, use_graphs: bool) -> DecodeGraphRunner:
        """The padded decode path over ``kv_caches``; ``use_graphs=False`` runs it eagerly (CPU tests, profiling)."""
        return DecodeGraphRunner(self.model, kv_caches, self.inputs, self.cfg.max_num_seqs, self.max_model_len,
                                 use_graphs)

    # ---- the step ----------------------------------------------------------------------------------------------
    def execute(self, sched: SchedulerOutput, logits_processor: LogitsProcessor | None = None) -> StepHandle:
        start = time.perf_counter()
        self._apply_deltas(sched)
        if not sched.num_scheduled:
            if sched.kv_transfers:  # in order with the steps' device work
                self.run_transfers(sched.kv_transfers)
            if sched.encode_images:  # a step that only encodes images (no room for their tokens yet)
                self._in_device_order(lambda: self.vision.encode(sched.encode_images))
            return StepHandle(self)
        graphs, batch = self.decode_graphs, self.batch
        pad_to = None
        if (graphs is not None and graphs.fits(batch.num_rows, int(batch.num_new[: batch.num_rows].max()))
                and not (self.vision is not None and self.vision.computes_images(batch))):
            pad_to = graphs.padded_size(batch.num_rows)
        host = flatten(batch, self.cfg.block_size, pad_to, self.num_state_rows if self.num_draft_states else -1)
        images = self.vision.plan(batch, host) if self.vision is not None else None
        all_ids = batch.seq_ids
        # every row samples in a decode-only step: the rows' ids as they are
        sample_rows = host.sample_rows
        every_row = len(sample_rows) == len(all_ids)
        seq_ids = all_ids[:] if every_row else [all_ids[r] for r in sample_rows.tolist()]
        work = _DeviceWork(host, pad_to, None, [], seq_ids, logits_processor, sched.kv_transfers,
                           state_restores=sched.state_restores, state_snapshots=sched.state_snapshots, images=images,
                           encode_images=sched.encode_images)
        if self.scoring:
            work.prompt_spans = self.scoring.spans(sched, batch.row_of, host.query_start_loc)
        handle = StepHandle(self, seq_ids, rows=host.sample_rows, batch_version=batch.version)
        if seq_ids and self.tp.is_first:  # rank 0 samples (module docstring)
            # the same rows, all sampling: the same sequences (else compare them)
            key = ("every row", batch.version) if every_row else tuple(seq_ids)
            work.sampling, work.sampled = self._sampling_batch_for(key, seq_ids)
            handle.params = work.sampling.params
        if seq_ids:
            if self.cfg.async_scheduling:  # the next step may be prepared before these ids are back
                batch.pending_src[host.sample_rows] = batch.row_numbers[: len(seq_ids)]
            batch.steps_unrecorded += 1
        if host.sample_counts is not None:
            work.drafts = [batch.drafts(r) for r in host.sample_rows.tolist()]
        self.profile.prepare_s += time.perf_counter() - start
        if self._device_thread is not None:
            handle.launched = self._device_thread.submit(self._run_on_device, work)
        else:
            handle.launched = self._run_on_device(work)
        return handle

    def _run_on_device(self, work: _DeviceWork) -> _Launched:
        """The device part of a step, timed whole: entering inference mode and freeing the forward's intermediates
        (as its frame goes) are the device part's too."""
        start, start_cpu = time.perf_counter(), time.thread_time()
        launched = self._device_part(work)
        self.profile.launch_s += time.perf_counter() - start
        self.profile.launch_cpu_s += time.thread_time() - start_cpu
        return launched

    @torch.inference_mode()
    def _device_part(self, work: _DeviceWork) -> _Launched:
        """Upload, forward, sample; on CUDA also start copying the sampled ids back. Steps run here in order."""
        if work.transfers:
            self.kv_offload.run(work.transfers)
        if work.encode_images:
            self.vision.encode(work.encode_images)
        self._copy_states(work.state_restores)
        host = work.host
        input_ids, positions = self.inputs.upload(host, self._prev_sampled)
        started = None
        if self.time_device and self.device.type == "cuda":
            started = torch.cuda.Event(enable_timing=True)
            started.record()
        if work.pad_to is not None:
            hidden = self.decode_graphs.run(work.pad_to)
        else:
            meta = self.inputs.metadata(host)
            if self._reads_sampled_rows_only(work, host):
                self.inputs.narrow_to_read_rows(meta, host)
            if work.images is None:
                hidden = self.model(input_ids, positions, self.kv_caches, meta)
            else:  # only the families with a vision tower take image tokens
                hidden = self.model(input_ids, positions, self.kv_caches, meta,
                                    mm=self.vision.device_inputs(work.images))
        self._copy_states(work.state_snapshots)
        sampled = self._sample(hidden, host, work) if len(host.sample_index) else None
        if self.mtp_drafter is not None:  # after acceptance: it catches up on the kept positions, then drafts
            drafts = self.mtp_drafter(hidden, self.kv_caches, host, self.inputs, self.batch,
                                      sampled and sampled.token_ids, sampled and sampled.emitted)
            if sampled is not None:
                sampled.drafts = drafts
        scored = score_spans(hidden, work.prompt_spans, self.model.compute_logits) if work.prompt_spans else []
        launched = self._to_host(sampled, scored, timed=started is not None)
        if sampled is not None or scored:
            launched.started = started
        return launched

    def _reads_sampled_rows_only(self, work: _DeviceWork, host: HostInputs) -> bool:
        """Whether only the sampled rows' hidden states are read after this (eager) step: no prompt logprobs, no MTP
        drafter, rows that do not sample; worth telling a model whose last layers store no K/V (Gemma 4 E2B / E4B's
        shared KV layers then skip the other rows, as transformers' prefill does)."""
        return (getattr(self.model, "stores_no_kv_from", None) is not None and not work.prompt_spans
                and self.mtp_drafter is None and len(host.sample_index) < host.num_tokens)

    def _copy_states(self, copies: list[StateCopy]) -> None:
        """Copy recurrent-state rows in every recurrent layer (a list never reads a slot it writes)."""
        if not copies:
            return
        src = torch.tensor([c.src for c in copies], device=self.device)
        dst = torch.tensor([c.dst for c in copies], device=self.device)
        for layer in self.kv_spec.state_layers(self.kv_caches):
            for states in layer:
                states.index_copy_(0, dst, states.index_select(0, src))

    def run_transfers(self, transfers: list[KVTransfer]) -> None:
        """Copies between KV tiers outside a step (a reset's disk clear), in order with the steps' device work."""
        if transfers:
            self._in_device_order(lambda: self.kv_offload.run(transfers))

    def _in_device_order(self, work: Callable[[], None]) -> None:
        """``work()`` after the device work already launched (on CPU with async scheduling, on its thread)."""
        if self._device_thread is not None:
            self._device_thread.submit(work).result()
        else:
            work()

    def _apply_deltas(self, sched: SchedulerOutput) -> None:
        """Bring the runner's sequence states and batch rows in line with the scheduler's view."""
        for seq_id in sched.finished_seq_ids:
            self.sequences.pop(seq_id, None)
            self.scoring.discard(seq_id)
        if self.vision is not None:
            self.vision.track([(new.seq_id, new.images) for new in sched.new_sequences], sched.finished_seq_ids)
        for new in sched.new_sequences:
            self.sequences[new.seq_id] = self._new_sequence(new)
            if new.params.prompt_logprobs is not None:
                self.scoring.add(new.seq_id, new.prompt_token_ids, new.params.prompt_logprobs)
        batch, seq_ids = self.batch, sched.seq_ids
        if batch.seq_ids != seq_ids:  # else the same sequences in the same rows as last step: nothing leaves
            batch.remove_all_but(set(seq_ids), set(sched.finished_seq_ids))
        row_of = batch.row_of
        for seq_id, slot in sched.state_rows.items():  # (re)admitted: the slot its recurrent layers' state lives in
            self.sequences[seq_id].state_row = slot
        for seq_id, block_ids in sched.new_block_ids.items():  # sparse: a steady decode has none
            seq = self.sequences[seq_id]
            if seq_id in sched.resumed:
                assert seq_id not in row_of, "a preempted sequence still has a row"
                seq.block_ids = list(block_ids)
            else:
                seq.block_ids.extend(block_ids)
                if seq_id in row_of:
                    batch.append_blocks(row_of[seq_id], block_ids)
        for seq_id, page_ids in sched.new_window_block_ids.items():  # sliding-window models: their window pages
            seq = self.sequences[seq_id]
            if seq_id in sched.resumed:
                seq.window_block_ids = list(page_ids)
            else:
                seq.window_block_ids.extend(page_ids)
                if seq_id in row_of:
                    batch.append_window_blocks(row_of[seq_id], page_ids)
        if len(row_of) < len(seq_ids):  # scheduled sequences without a row (a row holds only scheduled ones)
            for seq_id in seq_ids:
                if seq_id not in row_of:
                    batch.add(self.sequences[seq_id])
        n = len(seq_ids)
        rows = slice(0, n) if batch.seq_ids == seq_ids else np.fromiter(map(row_of.__getitem__, seq_ids), np.intp, n)
        batch.num_computed[rows] = sched.num_computed_tokens
        batch.num_new[rows] = sched.num_new_tokens
        batch.samples[rows] = sched.samples
        batch.num_drafts[rows] = 0
        for seq_id, drafts in sched.drafts.items():
            batch.set_drafts(row_of[seq_id], drafts)

    def _new_sequence(self, new: NewSequence) -> RunnerSequence:
        samples_here = self.tp.is_first  # generators and penalty histories live where sampling happens
        seq = RunnerSequence(new.seq_id, list(new.prompt_token_ids), new.params,
                            None if new.seed is None or not samples_here else make_generator(new.seed, self.device))
        if has_penalties(new.params) and samples_here:
            vocab = self.model_cfg.vocab_size
            seq.output_counts = torch.zeros(vocab, device=self.device)
            seq.prompt_seen = torch.zeros(vocab, dtype=torch.bool, device=self.device)
            if new.params.repetition_penalty != 1.0:
                seq.prompt_seen[torch.tensor(new.prompt_token_ids, device=self.device)] = True
        return seq

    def _sample(self, hidden: torch.Tensor, host: HostInputs, work: _DeviceWork) -> SamplerOutput:
        rows = len(host.sample_index)
        if rows < len(hidden):  # else every token row samples (a decode-only step): no gather
            index = torch.from_numpy(host.sample_index).to(self.device, non_blocking=True).long()
            hidden = hidden.index_select(0, index)
        logits = self.model.compute_logits(hidden)
        if logits is None:  # rank 0 samples; this rank receives the ids
            out = SamplerOutput(torch.empty(rows, dtype=torch.long, device=self.device), [])
        else:
            if work.logits_processor is not None:  # every position: a draft's verification is masked too
                counts = host.sample_counts.tolist() if host.sample_counts is not None else None
                work.logits_processor(logits, work.seq_ids, counts)
            all_logits = logits
            if host.sample_counts is not None:  # each row samples at its first position; drafts are verified below
                firsts = np.cumsum(host.sample_counts) - host.sample_counts
                logits = logits.index_select(0, torch.from_numpy(firsts).to(self.device).long())
            penalties = self._penalties_for(work.sampling, work.sampled) if work.sampling.penalized_rows else None
            out = sample(logits, work.sampling, penalties)
            if work.drafts is not None:
                out.emitted = self._verify(all_logits, host.sample_counts, out, work)
            if penalties is not None:  # count each new token in its row's history, on the device (one op)
                every_row = torch.arange(rows, device=self.device)
                penalties.output_counts.index_put_((every_row, out.token_ids), torch.ones(rows, device=self.device),
                                                   accumulate=True)
        self.tp.broadcast_from_first(out.token_ids)
        if work.drafts is not None and self.tp.size > 1:
            out.emitted = self._share_emitted(out.emitted, host.sample_counts)
        if work.drafts is not None:  # every rank: its shard of the recurrent state
            self._keep_accepted_states(host, out.emitted)
        self._prev_sampled = out.token_ids
        return out

    def _share_emitted(self, emitted: list[list[int]] | None, counts: np.ndarray) -> list[list[int]]:
        """Tensor parallelism: rank 0 verified the drafts; every rank needs each row's emitted tokens (at most 1 +
        its drafts) for its rows' next inputs. One broadcast of a padded table."""
        table = torch.full((len(counts), int(counts.max())), -1, dtype=torch.long)
        if emitted is not None:  # rank 0
            for i, tokens in enumerate(emitted):
                table[i, : len(tokens)] = torch.tensor(tokens)
        shared = self.tp.broadcast_from_first(table.to(self.device)).tolist()
        return emitted if emitted is not None else [[t for t in row if t >= 0] for row in shared]

    def _verify(self, logits: torch.Tensor, counts: np.ndarray, out: SamplerOutput, work: _DeviceWork
                ) -> list[list[int]]:
        """Speculative decoding: the drafting rows' tokens by the exact acceptance rules (engine/spec/verify.py);
        a row without drafts emits the token sampled for it. Returns every sampled row's tokens (host lists: a
        sync, which a speculative step takes anyway before the next is scheduled)."""
        drafted = np.nonzero(counts > 1)[0]
        firsts = np.cumsum(counts) - counts
        index = np.concatenate([np.arange(firsts[i], firsts[i] + counts[i]) for i in drafted])
        params, generators = work.sampling.params, work.sampling.generators
        emitted_drafted = verify(logits.index_select(0, torch.from_numpy(index).to(self.device).long()),
                                 [work.drafts[i] for i in drafted], [params[i] for i in drafted],
                                 [generators[i] for i in drafted])
        emitted = [[t] for t in out.token_ids.tolist()]
        for i, tokens in zip(drafted.tolist(), emitted_drafted):
            emitted[i] = tokens
        out.token_ids[torch.from_numpy(drafted).to(self.device).long()] = torch.tensor(
            [tokens[0] for tokens in emitted_drafted], device=self.device)
        return emitted

    def _keep_accepted_states(self, host: HostInputs, emitted: list[list[int]]) -> None:
        """Hybrid models: a verification row's recurrent state ran past its last accepted draft; the state after it
        was kept in a draft-state row (`flatten`), from where it goes back to the row's own slot."""
        if host.draft_states is None:
            return
        copies = []
        for row, tokens in zip(host.sample_rows.tolist(), emitted):
            accepted, drafts = len(tokens) - 1, int(host.draft_counts[row])
            if accepted < drafts:
                copies.append(StateCopy(int(host.draft_states[row]) + accepted, int(host.state_rows[row])))
        self._copy_states(copies)

    def _to_host(self, sampled: SamplerOutput | None, scored: list[ScoredSpan], timed: bool) -> _Launched:
        """On CUDA, start copying the step's results into pinned host memory; the event marks the copies done."""
        if self.device.type != "cuda" or (sampled is None and not scored):
            return _Launched(sampled, scored)
        done = torch.cuda.Event(enable_timing=timed)
        launched = _Launched(sampled and _to_pinned(sampled), [s.copied(_pinned) for s in scored], done)
        done.record()
        return launched

    def _sampling_batch_for(self, key: tuple, seq_ids: list[str]) -> tuple[SamplingBatch, list[RunnerSequence]]:
        """The sampler's per-row tensors and the rows' sequences, rebuilt only when the sampling sequences (``key``)
        change."""
        if self._sampling_batch is None or self._sampling_batch[0] != key:
            seqs = [self.sequences[r] for r in seq_ids]
            batch = SamplingBatch([r.params for r in seqs], [r.generator for r in seqs], self.device)
            self._sampling_batch = (key, batch, seqs)
        return self._sampling_batch[1], self._sampling_batch[2]

    def _penalties_for(self, sampling: SamplingBatch, seqs: list[RunnerSequence]) -> Penalties:
        """The batch's penalty tensors, built on the device thread (so in step order) when the batch changes: each
        penalized sequence's output counts then become a row of the batch's ``[B, V]`` counts, which every step
        updates in place; rows without penalties hold neutral parameters."""
        if self._penalties is not None and self._penalties[0] is sampling:
            return self._penalties[1]
        if self._penalties is not None:  # the sequences leaving the batch take their counts with them
            staying = {id(seq) for seq in seqs}
            for seq in self._penalties[2]:
                if id(seq) not in staying:
                    seq.output_counts = seq.output_counts.clone()
        vocab = self.model_cfg.vocab_size
        counts = torch.zeros(len(seqs), vocab, device=self.device)
        seen = torch.zeros(len(seqs), vocab, dtype=torch.bool, device=self.device)
        for i in sampling.penalized_rows:
            seq = seqs[i]
            counts[i] = seq.output_counts
            seq.output_counts = counts[i]  # a view: the batch's updates are the sequence's
            if seq.prompt_seen is not None:
                seen[i] = seq.prompt_seen
        penalties = Penalties(*penalty_parameters(sampling.params, self.device), counts, seen)
        self._penalties = (sampling, penalties, [seqs[i] for i in sampling.penalized_rows])
        return penalties

    def record_sampled(self, handle: StepHandle, token_ids: np.ndarray, emitted: list[list[int]] | None = None
                       ) -> None:
        """A step's sampled ids reached the host: append them to each sequence's row (or, rowless, its tokens).
        ``emitted``: speculative decoding's tokens per row, which replace the one sampled id each."""
        batch = self.batch
        batch.steps_unrecorded -= 1
        if emitted is not None:  # a speculative step is collected before the next is scheduled: rows unchanged
            assert batch.version == handle.batch_version, "rows moved under a speculative step"
            batch.append_token_lists(handle.rows.tolist(), emitted)
            return
        if batch.version == handle.batch_version:  # the rows are as the step left them (always, without overlap)
            batch.append_tokens(handle.rows, token_ids)
            return
        rows, row_tokens = [], []
        for seq_id, token in zip(handle.seq_ids, token_ids.tolist()):
            row = batch.row_of.get(seq_id)
            if row is not None:
                rows.append(row)
                row_tokens.append(token)
            elif (seq := self.sequences.get(seq_id)) is not None:  # else finished while the step ran
                seq.token_ids.append(token)
        batch.append_tokens(rows, row_tokens)

    # ---- memory budget -----------------------------------------------------------------------------------------
    def _capture_decode_graphs(self) -> DecodeGraphRunner:
        start = time.perf_counter()
        torch.cuda.empty_cache()  # capture empties the cache too; release it first so the free-memory delta is real
        free_before = torch.cuda.mem_get_info(self.device)[0]
        graphs = self.make_decode_graphs(self.kv_caches, use_graphs=True)
        graphs.capture()
        used = free_before - torch.cuda.mem_get_info(self.device)[0]
        log.info("captured %d decode CUDA graphs (batch sizes up to %d) in %.1fs, using %.2f GiB",
                 len(graphs.sizes), graphs.sizes[-1], time.perf_counter() - start, used / 2**30)
        return graphs

    def _size_cache(self, use_graphs: bool) -> tuple[int, int]:
        """``(KV blocks, state snapshots)``: as configured, or from the memory budget. A hybrid model's running
        sequences' states come out of the budget first; of the rest, snapshots take ``state_snapshot_fraction``
        and blocks the remainder (with ``num_kv_blocks`` given, snapshots take that fraction of blocks + snapshots)."""
        cfg, spec = self.cfg, self.kv_spec.recurrent
        per_block = self.kv_spec.bytes_per_block(cfg.block_size, cfg.kv_cache_torch_dtype)
        if self.window_group:
            return self._size_window_cache(per_block, use_graphs)
        state = spec.bytes_per_state(self.dtype) if spec is not None else 0
        fraction = cfg.state_snapshot_fraction
        if cfg.num_kv_blocks:
            snapshots = cfg.num_state_snapshots
            if snapshots is None:
                snapshots = int(fraction / (1 - fraction) * cfg.num_kv_blocks * per_block) // state if state else 0
            return cfg.num_kv_blocks, snapshots
        budget = self._kv_memory_budget(use_graphs) - (cfg.max_num_seqs + self._num_draft_states()) * state
        snapshots = cfg.num_state_snapshots
        if snapshots is None:
            snapshots = int(fraction * budget) // state if state else 0
        blocks = int(budget - snapshots * state) // per_block
        if blocks < 1:
            raise ValueError("no memory left for the KV cache; raise --gpu-memory-utilization / --kv-cache-memory-gb "
                             "or use a smaller model")
        log.info("KV cache: %d blocks of %d tokens (%.1f GiB)%s", blocks, cfg.block_size, blocks * per_block / 2**30,
                 f"; {snapshots} state snapshots ({snapshots * state / 2**30:.1f} GiB)" if state else "")
        return blocks, snapshots

    def _size_window_cache(self, per_block: int, use_graphs: bool) -> tuple[int, int]:
        """A sliding-window model's ``(full-attention blocks, 0)``, its window pages in ``_num_window_blocks``: the
        running sequences' windows come out of the budget first (each holds the pages its window and its last block
        boundary's window touch, and a step's chunks one page per block they write); of the rest, retained windows
        take ``window_retention_fraction`` and full-attention blocks the remainder (with ``num_kv_blocks`` given,
        retained windows take that fraction of blocks + retained windows)."""
        cfg, spec = self.cfg, self.kv_spec
        per_page = spec.window_bytes_per_block(cfg.block_size, cfg.kv_cache_torch_dtype)
        per_full = per_block - per_page
        running = (cfg.max_num_seqs * (-(-(spec.window - 1) // cfg.block_size) + 2)
                   + -(-cfg.max_num_batched_tokens // cfg.block_size))
        fraction = cfg.window_retention_fraction
        if cfg.num_kv_blocks:
            blocks = cfg.num_kv_blocks
            retained = int(fraction / (1 - fraction) * blocks * per_full) // per_page
        else:
            budget = self._kv_memory_budget(use_graphs) - running * per_page
            retained = int(fraction * budget) // per_page
            blocks = int(budget - retained * per_page) // per_full
            if blocks < 1:
                raise ValueError("no memory left for the KV cache; raise --gpu-memory-utilization / "
                                 "--kv-cache-memory-gb or use a smaller model")
        self._num_window_blocks = cfg.num_window_blocks or running + retained
        log.info("KV cache: %d full-attention blocks of %d tokens (%.1f GiB); %d window pages (%.1f GiB, window %d)",
                 blocks, cfg.block_size, blocks * per_full / 2**30, self._num_window_blocks,
                 self._num_window_blocks * per_page / 2**30, spec.window)
        return blocks, 0

    def _kv_memory_budget(self, use_graphs: bool) -> int:
        """Bytes for KV blocks and recurrent states. On CUDA: ``total * gpu_memory_utilization`` minus the peak of tensors
        (weights plus a profiled full-size step), minus memory outside torch's allocator (CUDA context, other
        processes), minus the decode graphs' pool.

        The graphs bake in the KV tensors' addresses, so they can only be captured after the cache is allocated;
        their pool is therefore reserved up front as the measured peak of the largest padded decode forward (the
        pool holds exactly that forward's intermediates, which smaller graphs reuse, plus the small outputs). What
        the graph executables themselves take is left to the utilization headroom; the capture logs its real cost.
        """
        if self.device.type != "cuda":
            return int(self.cfg.kv_cache_memory_gb * 2**30)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._profile_run()
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        graph_pool = self._profile_decode_graphs() if use_graphs else 0
        free, total = torch.cuda.mem_get_info(self.device)
        outside_torch = total - free - torch.cuda.memory_reserved(self.device)
        if use_graphs:
            log.info("reserved %.2f GiB for decode graphs", graph_pool / 2**30)
        return int(total * self.cfg.gpu_memory_utilization - peak - graph_pool - outside_torch)

    @torch.inference_mode()
    def _profile_run(self) -> None:
        """The largest step the scheduler can build: ``max_num_batched_tokens`` prompt tokens (in sequences of at most
        ``max_model_len``, the positions RoPE covers), then logits and sampling for ``max_num_seqs`` rows on the
        sampler's most expensive path.

        Every token goes to block 0 of a one-block scratch cache: what the blocks hold does not change the
        activations, and a real-size scratch cache would count KV memory as activation peak.
        """
        n, longest, bs, dev = self.cfg.max_num_batched_tokens, self.max_model_len, self.cfg.block_size, self.device
        lengths = [min(longest, n - first) for first in range(0, n, longest)]
        positions = torch.cat([torch.arange(length) for length in lengths]).to(dev)
        ends = torch.tensor(lengths).cumsum(0)
        starts = np.concatenate([[0], ends.numpy()]).astype(np.int32)
        meta = AttentionMetadata(
            slot_mapping=positions % bs,
            block_tables=torch.zeros(len(lengths), -(-longest // bs), dtype=torch.int32, device=dev),
            context_lens=torch.tensor(lengths, dtype=torch.int32, device=dev),
            query_start_loc=torch.from_numpy(starts).to(dev),
            max_query_len=max(lengths), max_context_len=max(lengths),
        )
        if self.kv_spec.recurrent is not None:  # every sequence in state row 0 of a one-slot scratch state
            none = np.zeros(len(lengths), dtype=np.int32)
            meta.states = StateBatch(meta.query_start_loc, torch.zeros(len(lengths), dtype=torch.long, device=dev),
                                     torch.zeros(len(lengths), dtype=torch.bool, device=dev), starts, none,
                                     none.astype(bool))
        hidden = self.model(torch.zeros(n, dtype=torch.long, device=dev), positions, self._new_caches(1, 1, 0), meta)
        rows = min(self.cfg.max_num_seqs, n)
        logits = self.model.compute_logits(hidden[-rows:])
        if logits is None:  # sampled on rank 0
            return
        params = [_PROFILE_PARAMS] * rows
        penalties = Penalties.from_histories(params, [[0]] * rows, [[0]] * rows, self.model_cfg.vocab_size, dev)
        sample(logits, SamplingBatch(params, [None] * rows, dev), penalties)

    def _profile_decode_graphs(self) -> int:
        """Bytes the decode graphs' pool will hold: the allocation peak of the largest padded decode forward (with
        its static buffers), measured eagerly over a one-block scratch cache (padding rows read block 0 only)."""
        caches = self._new_caches(1, 1, 0)
        torch.cuda.reset_peak_memory_stats(self.device)
        baseline = torch.cuda.memory_allocated(self.device)
        graphs = self.make_decode_graphs(caches, use_graphs=False)
        graphs.forward_padding(graphs.sizes[-1])
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) - baseline


def _use_expandable_segments() -> None:
    """Let CUDA segments grow in place (PyTorch's expandable segments) unless the user configured the allocator.

    The KV pool takes what the profiled peak leaves of ``total * gpu_memory_utilization``; fixed-size segments then
    strand memory between steps of varying shapes, and an eager engine on an H200 held 126.4 GiB against its
    125.8 GiB budget (2.1 GiB reserved over the peak allocated)."""
    if not {"PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"} & os.environ.keys():
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")


def _pinned(t: torch.Tensor | None) -> torch.Tensor | None:
    """Start copying ``t`` into pinned host memory without blocking the host."""
    if t is None:
        return None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


def _to_pinned(out: SamplerOutput) -> SamplerOutput:
    """The sampled ids (and logprobs), copied to pinned host memory."""
    return SamplerOutput(_pinned(out.token_ids), out.logprob_rows, _pinned(out.chosen_logprobs), _pinned(out.top_ids),
                         _pinned(out.top_logprobs), out.emitted, out.drafts)
