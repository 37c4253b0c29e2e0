"""How a sequence ends and what it reports: its blocks freed (or held for a finished request's next turn), its
counters and the drafter's state released, its siblings told of an error; the `SequenceInfo` of its first output;
and the step outputs the engine collects.

`Finishing` is a part of `engine.sched.scheduler.Scheduler`, split off so that the scheduler's module reads as the
algorithm; it uses the scheduler's queues, KV manager, drafter and outputs.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from engine.outputs import FinishReason, SequenceInfo, StepOutputs
from engine.sched.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from engine.sched.scheduler import Scheduler

MAX_HELD_REQUESTS = 4096  # finished requests whose hold a caller may still extend (`retain_finished`)


class Finishing:
    """Mixed into `Scheduler` (whose attributes it reads: see the module docstring)."""

    def _finish(self: Scheduler, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self._running.remove(seq)
            hold = seq.retention.hold_after_finish_s if seq.retention else 0.0
            if hold > 0 and seq.index == 0:
                self._remember_held(seq)
            self.kv.free(seq.seq_id, hold)
        elif seq.status is not SequenceStatus.FINISHED:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.timings.finished = time.perf_counter()
        del self.sequences[seq.seq_id]
        self.num_constrained -= seq.params.structured_output is not None
        self.num_budgeted -= seq.phase is not None
        method = self.speculation(seq)
        self.num_speculative -= method != "off"
        self.drafter.finished(seq.seq_id, seq.token_ids if method == "suffix" else None, self._session(seq))
        self._finished_seq_ids.append(seq.seq_id)
        group = self.requests[seq.request_id]
        group.remove(seq)
        if not group:
            del self.requests[seq.request_id]
        if error is not None:
            # Siblings that were never queued end the same way, so the caller hears of all n sequences.
            info = seq.info or self._info(seq)
            for index in [seq.index, *range(1, seq.pending_siblings + 1)]:
                self._outputs.errors[self._outputs.add(seq.request_id, index, [], info, reason)] = error
        seq.pending_siblings = 0

    def _finish_prefill_only(self: Scheduler, seq: Sequence) -> None:
        row = self._outputs.add(seq.request_id, seq.index, [], seq.info or self._info(seq), FinishReason.LENGTH)
        if seq.prompt_logprobs is not None:
            self._outputs.prompt_logprobs[row] = seq.prompt_logprobs
        self._finish(seq, FinishReason.LENGTH)

    def _remember_held(self: Scheduler, seq: Sequence) -> None:
        tenant = seq.retention.tenant if seq.retention else None
        self._held[seq.request_id] = (seq.block_hashes[: self.kv.num_shared_blocks(seq.seq_id)], tenant)
        while len(self._held) > MAX_HELD_REQUESTS:
            self._held.popitem(last=False)

    def retain_finished(self: Scheduler, request_id: str, seconds: float) -> int:
        """Set the hold on a finished request's blocks (prompt and reply) to ``seconds`` from now (0: release them).
        Returns the blocks retained (0: the request had no hold, or it was forgotten)."""
        held = self._held.pop(request_id, None)
        return 0 if held is None else self.kv.retain_chain(held[0], seconds, tenant=held[1])

    def _info(self: Scheduler, seq: Sequence) -> SequenceInfo:
        """At a sequence's first output (after its admission, which fixed what the cache served of its prompt, and
        its prefill, whose blocks its pins retained or the cap refused)."""
        seq.info = SequenceInfo(seq.num_prompt_tokens, seq.num_cached_tokens, seq.num_host_cached_tokens,
                                seq.num_disk_cached_tokens, seq.timings, self.kv.num_pinned_tokens(seq.seq_id))
        return seq.info

    def take_outputs(self: Scheduler) -> StepOutputs:
        """What the steps since the last call produced (one `StepOutputs`)."""
        outputs, self._outputs = self._outputs, StepOutputs()
        return outputs
