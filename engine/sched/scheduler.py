"""Continuous batching, and the only owner of the KV manager and the request queues.

Each step, `schedule()` takes running decodes first (one token each), then continuing chunked prefills, then new
requests in policy order, within a token budget, and returns a `SchedulerOutput` of deltas for the model runner.
`update()` takes the sampled tokens back. Blocks are committed to the prefix cache as soon as the step that fills
them is scheduled (a later step that reads them runs after it), and again when a sampled token completes a block.

With async scheduling, step N+1 is scheduled before step N's tokens are back: a sequence that will sample in a step
gets a placeholder (``Sequence.num_output_placeholders``), which `update()` replaces with the real token.
"""
from __future__ import annotations

import time
from collections import OrderedDict, abc, deque
from collections.abc import Callable
from dataclasses import replace
from typing import TypeVar

import numpy as np

from engine.kv.block_hashing import BlockHash, BlockHasher
from engine.config import EngineConfig, SchedulingPolicy
from engine.kv.snapshot_policy import DEFAULT_POLICY, SnapshotPolicy
from engine.kv.layout import KVLayout
from engine.kv.manager import KVCacheManager
from engine.errors import RequestRejected
from engine.multimodal import ImageInput
from engine.phase_budget import PhaseTracker
from engine.outputs import (
    FinishReason,
    ModelRunnerOutput,
    NewSequence,
    SchedulerOutput,
    StepOutputs,
)
from engine.sched.sequence import Sequence, SequenceStatus
from engine.retention import Retention
from engine.sched.running_columns import RunningColumns
from engine.sched.finishing import Finishing
from engine.sched.image_encoding import ImageEncoding, whole_images
from engine.sched.queries import SchedulerQueries
from engine.sched.resume_points import ResumePoints
from engine.sched.speculation import SpeculationSteps
from engine.sched.steady import MIN_COLUMNAR_ROWS, SteadyPath
from engine.sampling_params import SamplingParams
from engine.spec.drafter import Drafter

T = TypeVar("T")


def admission_order(policy: SchedulingPolicy, candidates: abc.Sequence[T], num_cached_tokens: Callable[[T], int]) -> list[T]:
    """The one meaning of each policy, shared by the scheduler and the prefix-cache simulator: FCFS keeps arrival
    order; LONGEST_PREFIX puts the candidates with the most cached tokens first (ties in arrival order)."""
    if policy is SchedulingPolicy.FCFS:
        return list(candidates)
    return sorted(candidates, key=lambda c: -num_cached_tokens(c))


class Scheduler(SteadyPath, SpeculationSteps, ResumePoints, ImageEncoding, Finishing, SchedulerQueries):
    def __init__(
        self, cfg: EngineConfig, layout: KVLayout, hasher: BlockHasher, max_model_len: int, eos_token_ids: set[int],
        *, record_events: bool = False, clock: Callable[[], float] = time.monotonic,
        snapshot_policy: SnapshotPolicy = DEFAULT_POLICY,
    ) -> None:
        self.cfg = cfg
        # hybrid models (state rows): where to snapshot the recurrent state, so that prefixes can be resumed
        self.snapshot_policy = snapshot_policy if layout.state_rows and cfg.enable_prefix_caching else None
        # sliding-window models (window pages): where to retain the window, at the same points
        self.window_policy = snapshot_policy if layout.window_blocks and cfg.enable_prefix_caching else None
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.kv = KVCacheManager(layout.num_blocks, cfg.block_size, cfg.enable_prefix_caching, cfg.eviction_policy,
                                 max_retained_fraction=cfg.max_retained_fraction,
                                 max_retained_share_per_tenant=cfg.max_retained_share_per_tenant,
                                 host_blocks=layout.host_blocks, disk_blocks=layout.disk_blocks,
                                 record_events=record_events, clock=clock, state_rows=layout.state_rows,
                                 host_states=layout.host_states, disk_states=layout.disk_states,
                                 window_blocks=layout.window_blocks, window=layout.window)
        self.hasher = hasher  # the engine's, shared with its request preparer
        self.waiting: deque[Sequence] = deque()
        # The running sequences in admission order (the last one is preempted first), as columns too
        self._running = RunningColumns(cfg.max_num_seqs)
        self.sequences: dict[str, Sequence] = {}  # every live sequence
        self.requests: dict[str, list[Sequence]] = {}  # caller request id -> its live sequences
        self.num_constrained = 0  # live sequences under a grammar: without any, the engine skips grammar work
        self.num_budgeted = 0  # live sequences with a phase budget (`SamplingParams.phase_budget`)
        # Speculative decoding (engine/spec/): proposes drafts for decoding sequences; the engine collects a step
        # before scheduling the next while any live sequence speculates (drafts continue its known tokens)
        self.drafter = Drafter(cfg.num_speculative_tokens, cfg.speculative_draft_budget)
        self.num_speculative = 0
        self.num_decode_steps = 0
        self._scoring_budget = 0  # prompt positions the step being scheduled may still score (`_scored`)
        # image tokens a step may encode (0: unbounded), and those the step being scheduled may still encode
        self._image_room_total = self._image_budget()
        self._image_room = 0
        self._image_seqs: list[Sequence] = []
        self._finished_seq_ids: list[str] = []  # for the next SchedulerOutput: the runner forgets them
        # finished with a hold: their block chains and the tenant the hold counts against
        self._held: OrderedDict[str, tuple[list[BlockHash], str | None]] = OrderedDict()
        self._outputs = StepOutputs()
        # the rows of the last sampled sequences (the runner's order), while neither they nor the rows change
        self._sampled_rows: tuple[list[str], int, np.ndarray] | None = None
        self.num_preemptions = 0
        self.num_prompt_tokens = 0  # computed prompt tokens (cache hits excluded)
        self.num_generation_tokens = 0

    # ---- requests ------------------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    cache_salt: str | None = None, retention: Retention | None = None,
                    block_hashes: list[BlockHash] | None = None, images: tuple[ImageInput, ...] = ()) -> None:
        """Queue a request; its n - 1 siblings are queued once its prompt is scheduled (they then hit its blocks).
        ``block_hashes``: the prompt's, made during the request's preparation (else here); ``images``: the
        prompt's (engine/multimodal.py)."""
        if any(i.bidirectional and i.num_tokens > self.cfg.max_num_batched_tokens for i in images):
            raise RequestRejected(f"an image of {max(i.num_tokens for i in images)} tokens is computed in one step, "
                                  f"but a step holds {self.cfg.max_num_batched_tokens} (--max-num-batched-tokens)")
        leader = self._new_sequence(request_id, 0, list(prompt_token_ids), params, cache_salt, retention,
                                    block_hashes, images)
        leader.pending_siblings = params.n - 1
        self.requests[request_id] = []
        self._enqueue(leader)

    def _new_sequence(self, request_id: str, index: int, prompt: list[int], params: SamplingParams,
                      cache_salt: str | None, retention: Retention | None,
                      block_hashes: list[BlockHash] | None = None, images: tuple[ImageInput, ...] = ()) -> Sequence:
        seq = Sequence(f"{request_id}#{index}" if index else request_id, prompt, len(prompt), params, cache_salt,
                      request_id=request_id, index=index, images=images,
                      # a prefill-only request (max_tokens 0) samples one token and drops it
                      max_num_tokens=min(len(prompt) + max(params.max_tokens, 1), self.max_model_len),
                      prompt_logprobs=None if params.prompt_logprobs is None else [None], retention=retention)
        if self.cfg.enable_prefix_caching:
            if block_hashes is not None:
                seq.block_hashes = list(block_hashes)
            else:
                self.hasher.extend(seq.block_hashes, seq.token_ids, cache_salt, images)
        if (policy := self.snapshot_policy or self.window_policy) is not None:
            pins = [p.num_tokens for p in retention.pins] if retention else []
            seq.snapshot_points = policy.prompt_points(
                len(prompt), self.cfg.block_size, retention.snapshot_hints if retention else (), pins)
        return seq

    def _enqueue(self, seq: Sequence, front: bool = False) -> None:
        self.sequences[seq.seq_id] = seq
        self.num_constrained += seq.params.structured_output is not None
        if seq.params.phase_budget is not None:
            seq.phase = PhaseTracker(seq.params.phase_budget, seq.num_prompt_tokens)
            self.num_budgeted += 1
        self.num_speculative += self.speculation(seq) != "off"
        self.requests[seq.request_id].append(seq)
        if front:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def abort(self, request_id: str, index: int | None = None) -> None:
        """Finish the request's sequences (or only sequence ``index``) now and free their blocks: the caller went
        away, or a stop string ended the sequence."""
        for seq in list(self.requests.get(request_id, ())):
            if index is None or seq.index == index:
                self._finish(seq, FinishReason.ABORT)

    @property
    def running(self) -> list[Sequence]:
        """The running sequences in admission order (the last one is preempted first)."""
        return self._running.seqs

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- the step ------------------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_seq_ids=self._finished_seq_ids)
        self._finished_seq_ids = []
        self.kv.begin_step()
        # speculation turns itself down as the batch grows (engine/spec/drafter.py)
        k = self.drafter.drafts_per_sequence(len(self.running)) if self.num_speculative else 0
        # Decodes first (one token each, latency-critical, plus any drafts), then continuing chunked prefills; more
        # than one token left to compute: a prefill.
        running, budget = self.running, self.cfg.max_num_batched_tokens
        self._scoring_budget = self.cfg.max_scored_tokens_per_step
        self._image_room, self._image_seqs = self._image_room_total, []
        if len(running) >= MIN_COLUMNAR_ROWS and not k:  # many plain decodes: by column arithmetic (steady.py)
            prefills, budget = self._schedule_running_by_columns(budget, out)
        else:
            decodes, prefills = [], []
            for seq in running:
                (prefills if len(seq.token_ids) + seq.num_output_placeholders - seq.num_computed_tokens > 1
                 else decodes).append(seq)
            budget = self._schedule_decodes_in_turn(decodes, budget, k, out)
        for seq in prefills:
            if budget == 0:
                break
            num_tokens = len(seq.token_ids) + seq.num_output_placeholders
            # Preempted earlier in this loop, or done: the tokens in flight reach max_tokens or the context length.
            if seq.status is not SequenceStatus.RUNNING or num_tokens >= seq.max_num_tokens:
                continue
            n = min(num_tokens - seq.num_computed_tokens, budget)
            if seq.images:  # images it reaches are encoded within the budget, or the chunk ends before them
                n, spent = self._fit_images(seq, seq.num_computed_tokens, n, budget, out)
                budget -= spent
            n = self._chunk(seq, self._scored(seq, n)) if n else 0
            if n == 0:  # a prompt to score, and the step's scoring budget is spent; or no room for an image
                continue
            drafts = self._drafts(seq, n, min(k, budget - n)) if k else []
            new_block_ids = self._make_room(seq, n + len(drafts) + self._mtp_lookahead(seq, n + len(drafts)), out)
            if new_block_ids is None:
                continue
            self._schedule(seq, n, new_block_ids, out, drafts=drafts)
            budget -= n + len(drafts)
        if not out.preempted_seq_ids:  # blocks just ran short: admitting new work would only thrash
            budget = self._admit_waiting(budget, out)
        if self._image_seqs:
            self._encode_ahead(budget, out)
        out.kv_transfers = self.kv.take_transfers()
        out.state_restores, out.state_snapshots = self.kv.take_state_copies()
        out.new_window_block_ids = self.kv.take_window_blocks()
        return out

    def _schedule_decodes_in_turn(self, decodes: list[Sequence], budget: int, k: int, out: SchedulerOutput) -> int:
        """`_schedule_decodes` one sequence at a time (a decode that drafts up to ``k`` tokens, needs a block, fills
        one, is still in its prompt or has siblings to queue takes the general path)."""
        block_size, held_blocks, running = self.cfg.block_size, self.kv.num_held_blocks, SequenceStatus.RUNNING
        seq_ids, num_new, num_computed, samples = out.seq_ids, out.num_new_tokens, out.num_computed_tokens, out.samples
        for seq in decodes:
            if budget == 0:
                break
            num_tokens = len(seq.token_ids) + seq.num_output_placeholders
            # Preempted earlier in this loop, or done: the tokens in flight reach max_tokens or the context length.
            if seq.status is not running or num_tokens >= seq.max_num_tokens:
                continue
            start = seq.num_computed_tokens
            n = num_tokens - start
            drafts = self._drafts(seq, n, min(k, budget - n)) if k else []
            if (drafts or n != 1 or num_tokens % block_size == 0 or start < seq.num_prompt_tokens
                    or num_tokens > held_blocks(seq.seq_id) * block_size or seq.pending_siblings):
                new_block_ids = self._make_room(seq, n + len(drafts), out)
                if new_block_ids is None:
                    continue
                self._schedule(seq, n, new_block_ids, out, drafts=drafts)
                n += len(drafts)
            else:  # what `_schedule` does for it
                seq_ids.append(seq.seq_id)
                num_new.append(1)
                num_computed.append(start)
                samples.append(True)
                seq.num_computed_tokens = num_tokens
                seq.num_output_placeholders += 1
            budget -= n
        return budget

    def _scored(self, seq: Sequence, n: int) -> int:
        """At most ``n`` tokens of ``seq`` this step; for a prompt to score (`SamplingParams.prompt_logprobs`), no
        more positions than the step's scoring budget has left (0 when it is spent): --max-scored-tokens-per-step
        spreads a long prompt's scoring over steps, other requests' tokens between them. Each position's logprobs
        are the same however its prompt is chunked."""
        start = seq.num_computed_tokens
        if seq.prompt_logprobs is None or start >= seq.num_prompt_tokens - 1:  # no position left that scores
            return n
        budget = self._scoring_budget
        scored = whole_images(seq.images, start, min(n, budget))  # never ending inside a Gemma 3 image ...
        if not scored and budget == self.cfg.max_scored_tokens_per_step:  # ... one larger than the budget: alone
            scored = whole_images(seq.images, start, n)
        self._scoring_budget = max(budget - (min(start + scored, seq.num_prompt_tokens - 1) - start), 0)
        return scored

    def _make_room(self, seq: Sequence, n: int, out: SchedulerOutput) -> list[int] | None:
        """Blocks for ``n`` more tokens of ``seq``, preempting the newest other unscheduled requests if needed."""
        self.kv.slide(seq.seq_id, seq.num_computed_tokens)  # sliding-window models: pages no query reads go first
        while (new_block_ids := self.kv.allocate(seq.seq_id, seq.num_computed_tokens + n)) is None:
            scheduled = set(out.seq_ids)  # rare: only when blocks run short
            victims = [r for r in self.running if r is not seq and r.seq_id not in scheduled]
            if victims:
                self._preempt(victims[-1], out)
            elif len(self.running) == 1:  # alone and still no room: the pool is too small for this sequence
                self._finish(seq, FinishReason.LENGTH, error="out of KV blocks")
                return None
            else:
                self._preempt(seq, out)
                return None
        return new_block_ids

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Recompute later: release the blocks now; its full blocks stay cached, so re-admission mostly hits."""
        self._running.remove(seq)
        if self.window_policy is not None:  # resumable where it stopped, within a block
            self.kv.keep_window(seq.seq_id, self.kv.num_shared_blocks(seq.seq_id) * self.cfg.block_size,
                                replaces_reply=True)
        self.kv.free(seq.seq_id)
        seq.status = SequenceStatus.PREEMPTED
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted_seq_ids.append(seq.seq_id)

    def _schedule(self, seq: Sequence, n: int, new_block_ids: list[int], out: SchedulerOutput,
                  resumed: bool = False, state_row: int = -1, drafts: list[int] | None = None) -> None:
        start = seq.num_computed_tokens
        end = start + n
        samples = end == seq.num_tokens  # reaches the last token: samples the next
        out.add(seq.seq_id, n, start, samples, new_block_ids, resumed, state_row, drafts)
        # Drafts are computed too, but never enter token_ids unless accepted, so nothing below commits them to the
        # prefix cache; update() rolls num_computed_tokens back to what was accepted.
        seq.num_computed_tokens = end + len(drafts or ())
        if start < seq.num_prompt_tokens:
            self.num_prompt_tokens += min(seq.num_prompt_tokens, end) - start
        if end // self.cfg.block_size > start // self.cfg.block_size:  # this step fills a block
            self._commit(seq)
            if self.snapshot_policy is not None and end % self.cfg.block_size == 0:
                self._snapshot(seq)
            if self.window_policy is not None:
                self._keep_windows(seq, start, end)
        if samples:
            seq.num_output_placeholders += 1
            if seq.pending_siblings:
                self._queue_siblings(seq)

    def _commit(self, seq: Sequence) -> None:
        """Cache the blocks whose tokens are known and computed (or being computed by a scheduled step)."""
        token_ids = seq.token_ids
        self.kv.commit(seq.seq_id, seq.block_hashes, token_ids, min(seq.num_computed_tokens, len(token_ids)))

    def _queue_siblings(self, leader: Sequence) -> None:
        """n > 1: the leader's prompt is scheduled, so its blocks are cached; the siblings queue first and share
        them, recomputing only the last partial block."""
        params = replace(leader.params, prompt_logprobs=None)  # the leader scores the prompt
        prompt_hashes = leader.block_hashes[: leader.num_prompt_tokens // self.cfg.block_size]
        siblings = [
            self._new_sequence(leader.request_id, i, leader.prompt_token_ids, params, leader.cache_salt, None,
                               prompt_hashes, leader.images)
            for i in range(1, leader.pending_siblings + 1)
        ]
        leader.pending_siblings = 0
        for sib in reversed(siblings):
            self._enqueue(sib, front=True)

    def _admit_waiting(self, budget: int, out: SchedulerOutput) -> int:
        """Admit waiting sequences while the budget, the sequence cap and the blocks allow; returns the budget
        left."""
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            seq = self._next_waiting()
            if seq.num_output_placeholders:  # preempted with a token still in flight: wait for it
                break
            resumed = seq.status is SequenceStatus.PREEMPTED
            if seq.prompt_logprobs is not None and not self._scoring_budget:  # it starts scoring in a later step
                break
            hashes = seq.block_hashes
            if seq.prompt_logprobs is not None:  # a position still to score is computed, never read from the cache
                hashes = hashes[: (len(seq.prompt_logprobs) - 1) // self.cfg.block_size]
            limit = budget
            if seq.images:  # images its first chunk reaches are encoded within the budget, or the chunk ends before
                start = self.kv.num_cached_tokens(hashes, len(seq.token_ids))  # what admission will take
                limit, spent = self._fit_images(seq, start, min(len(seq.token_ids) - start, budget), budget, out)
                budget -= spent
                if limit == 0:
                    break
            cached = self.kv.admit(seq.seq_id, hashes, seq.token_ids, budget, resumed, seq.retention)
            if cached is None:
                break
            self.waiting.remove(seq)
            if not resumed:
                seq.num_cached_tokens = min(cached, seq.num_prompt_tokens)
                seq.num_host_cached_tokens, seq.num_disk_cached_tokens = self.kv.lower_tier_hits(seq.seq_id)
                seq.timings.scheduled = time.perf_counter()
                out.new_sequences.append(NewSequence(seq.seq_id, seq.prompt_token_ids, seq.params, seq.seed,
                                                            seq.images))
            seq.status = SequenceStatus.RUNNING
            seq.num_computed_tokens = cached
            n = self._chunk(seq, self._scored(seq, min(seq.num_uncomputed_tokens, limit)))
            self._running.append(seq)
            self._schedule(seq, n, list(self.kv.block_table(seq.seq_id)), out, resumed,
                           self.kv.state_row(seq.seq_id))
            budget -= n
        return budget

    def _next_waiting(self) -> Sequence:
        head = self.waiting[0]
        if head.status is SequenceStatus.PREEMPTED or self.cfg.scheduling_policy is SchedulingPolicy.FCFS:
            return head  # preempted sequences come back first, whatever the policy
        kv = self.kv
        return admission_order(self.cfg.scheduling_policy, self.waiting,
                               lambda r: kv.num_cached_tokens(r.block_hashes, len(r.token_ids)))[0]

    # ---- sampled tokens back -------------------------------------------------------------------------------------
    def update(self, runner_output: ModelRunnerOutput, grammar_ends: dict[str, str | None] | None = None) -> None:
        """Append each sequence's sampled token and finish those that stop; outputs are collected by `take_outputs`.

        ``grammar_ends``: sequences whose grammar ended with this token: whole (None), which stop whatever
        ``ignore_eos`` says, since nothing may follow a whole structured output; or failed (why), which end alone
        with `FinishReason.ERROR`, the token dropped."""
        grammar_ends = grammar_ends or {}
        now = time.perf_counter()
        for seq_id, first, entries in runner_output.prompt_logprobs:  # before the tokens the same step sampled
            seq = self.sequences.get(seq_id)
            if seq is not None and seq.prompt_logprobs is not None:  # a recompute may score some tokens again
                seq.prompt_logprobs += entries[len(seq.prompt_logprobs) - first :]
        if not grammar_ends and self._update_by_columns(runner_output, now):  # a steady step (steady.py)
            return
        logprobs = runner_output.logprobs or [None] * len(runner_output.seq_ids)
        sequences, outputs, eos = self.sequences, self._outputs, self.eos_token_ids
        block_size = self.cfg.block_size if self.cfg.enable_prefix_caching else 0
        emitted = runner_output.emitted()
        speculative, decode_steps, generated = self.num_speculative, 0, 0
        mtp_drafts = runner_output.draft_token_ids or [None] * len(runner_output.seq_ids)
        for seq_id, tokens, logprob, drafts in zip(runner_output.seq_ids, emitted, logprobs, mtp_drafts):
            seq = sequences.get(seq_id)
            if seq is None:  # finished (stop, abort) after this step was scheduled: its token is moot
                continue
            seq.num_output_placeholders -= 1
            params = seq.params
            if params.max_tokens == 0:  # prefill only: the sampled token is no output
                self._finish_prefill_only(seq)
                continue
            if grammar_ends and grammar_ends.get(seq_id) is not None:  # its grammar failed: it ends here, alone
                self._finish(seq, FinishReason.ERROR, error=grammar_ends[seq_id])
                continue
            if speculative:
                self._record_speculation(seq, tokens)
            decode_steps += 1
            if seq.timings.first_token is None:
                seq.timings.first_token = now
            token_ids, reason, count = seq.token_ids, None, 0
            for token in tokens:  # one token, or the accepted drafts and the target's own
                seq.append_token(token)
                count += 1
                if block_size and len(token_ids) % block_size == 0:  # a block is full
                    self.hasher.extend(seq.block_hashes, token_ids, seq.cache_salt, seq.images)
                    if seq.status is SequenceStatus.RUNNING:
                        self._commit(seq)
                # a grammar that ended did so with the step's last token (the engine cut what followed)
                if (seq_id in grammar_ends and count == len(tokens)) or (token in eos and not params.ignore_eos) \
                        or token in params.stop_token_ids:
                    reason = FinishReason.STOP
                elif len(token_ids) >= seq.max_num_tokens:  # max_tokens, or the context length
                    reason = FinishReason.LENGTH
                if reason is not None:  # a stop token or max_tokens among them: what follows is dropped
                    break
            if drafts is not None and reason is None:
                self.drafter.offer(seq_id, len(token_ids), drafts)
            generated += count
            row = outputs.add(seq.request_id, seq.index, tokens if count == len(tokens) else tokens[:count],
                              seq.info or self._info(seq))
            if logprob is not None:
                outputs.logprobs[row] = [logprob] * count
            if seq.prompt_logprobs is not None:  # with the first token
                outputs.prompt_logprobs[row], seq.prompt_logprobs = seq.prompt_logprobs, None
            if reason is not None:
                outputs.finish_reasons[row] = reason
                stats = self.drafter.request_stats.get(seq.seq_id)
                if stats is not None:
                    outputs.speculation[row] = stats
                self._finish(seq, reason)
        self.num_decode_steps += decode_steps
        self.num_generation_tokens += generated

    # ---- observation -----------------------------------------------------------------------------------------------