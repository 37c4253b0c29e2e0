"""Where a sequence leaves state that a later request can resume from, for the cache groups that need more than full
blocks: a hybrid model's recurrent-state snapshots (a prefill chunk ends at each snapshot point, where the state
exists) and a sliding-window model's retained windows. The points come from the snapshot policy
(engine/kv/snapshot_policy.py): prompt ends, reply ends, breakpoints and the server's message-boundary hints.

`ResumePoints` is a part of `engine.sched.scheduler.Scheduler`, split off so that the scheduler's module reads as
the algorithm; it uses the scheduler's config, policies and KV manager.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from engine.sched.sequence import Sequence

if TYPE_CHECKING:
    from engine.sched.scheduler import Scheduler


class ResumePoints:
    """Mixed into `Scheduler` (whose attributes it reads: see the module docstring)."""

    def _chunk(self: Scheduler, seq: Sequence, n: int) -> int:
        """Hybrid models: end a prefill chunk at the first snapshot point inside it (the state there exists only at
        the end of a step)."""
        if self.snapshot_policy is None:  # (a sliding-window model retains its windows wherever a chunk ends)
            return n
        start = seq.num_computed_tokens
        for point in seq.snapshot_points:
            if start < point < start + n:
                return point - start
        return n

    def _snapshot(self: Scheduler, seq: Sequence) -> None:
        """Hybrid models: keep the state the step being scheduled leaves ``seq`` in, if the policy wants it."""
        end, policy = seq.num_computed_tokens, self.snapshot_policy
        if end in seq.snapshot_points:
            self.kv.take_snapshot(seq.seq_id, end)
        elif policy.in_reply(end, seq.num_prompt_tokens, self.cfg.block_size):
            self.kv.take_snapshot(seq.seq_id, end, replaces_reply=True)

    def _keep_windows(self: Scheduler, seq: Sequence, start: int, end: int) -> None:
        """Sliding-window models: retain the window at the policy's points the step being scheduled reaches (its
        prompt's points, and in the reply its last block boundary, replacing the previous one)."""
        for point in seq.snapshot_points:
            if start < point <= end:
                self.kv.keep_window(seq.seq_id, point)
        boundary = end // self.cfg.block_size * self.cfg.block_size
        if self.window_policy.reply_end and boundary > seq.num_prompt_tokens:
            self.kv.keep_window(seq.seq_id, boundary, replaces_reply=True)
