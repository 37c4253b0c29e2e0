"""The scheduler's part in speculative decoding (engine/spec/): which proposer a sequence drafts with, how many drafts a
decode step carries (never past max_tokens, a hybrid model's next snapshot boundary or a phase budget, never at the
price of a preemption), the room MTP's chained drafts need, and rolling a sequence back to its accepted drafts.

`SpeculationSteps` is a part of `engine.sched.scheduler.Scheduler`, split off so that the scheduler's module reads as
the algorithm; it uses the scheduler's config, KV manager and drafter.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from engine.sched.sequence import Sequence
from engine.spec.drafter import Method

if TYPE_CHECKING:
    from engine.sched.scheduler import Scheduler


class SpeculationSteps:
    """Mixed into `Scheduler` (whose attributes it reads: see the module docstring)."""

    def speculation(self: Scheduler, seq: Sequence) -> Method:
        """The proposer a sequence drafts with: its own choice, else the engine's. Penalties and logprobs (which
        would need every draft's distribution) keep a sequence to one token per step; grammars do not (each
        verified position is masked by the grammar's state after the drafts before it)."""
        p = seq.params
        method = p.speculative or self.cfg.speculative
        if method == "off" or p.logprobs is not None or p.max_tokens == 0 \
                or p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
            return "off"
        return method

    def _session(self: Scheduler, seq: Sequence) -> tuple[str | None, str | None]:
        """Whose earlier text the suffix proposer drafts from: the tenant's (cache salt) session."""
        return seq.cache_salt, seq.params.speculative_session

    def _drafts(self: Scheduler, seq: Sequence, n: int, k: int) -> list[int]:
        """Up to ``k`` drafts after a decoding sequence's last token; never more than its max_tokens leaves room for
        (the step emits one token beyond the accepted drafts)."""
        decoding = n == 1 and seq.num_computed_tokens == len(seq.token_ids) - 1 and not seq.num_output_placeholders
        k = min(k, seq.max_num_tokens - len(seq.token_ids) - 1)
        if self.snapshot_policy is not None:
            # Hybrid models snapshot the state at block boundaries, which exists only at the end of a step: a step
            # with drafts stops short of the next boundary (the token completing a block is verified alone)
            k = min(k, -(seq.num_computed_tokens + n) % self.cfg.block_size - 1)
        if seq.phase is not None:  # no draft reaches past a phase budget: the tokens after it are forced
            seq.phase.advance(seq.token_ids)
            left = seq.phase.free_tokens_left()
            k = k if left is None else min(k, left - 1)
        if not decoding or k <= 0:
            return []
        drafts = self.drafter.propose(seq.seq_id, self.speculation(seq), seq.token_ids, k, self._session(seq))
        # drafts never cost a preemption: without free blocks for them the sequence decodes one token
        extra = self.kv.blocks_needed(seq.num_computed_tokens + n + len(drafts)) - len(self.kv.block_table(seq.seq_id))
        return drafts if extra <= self.kv.num_free_blocks else []

    def _mtp_lookahead(self: Scheduler, seq: Sequence, n: int) -> int:
        """MTP: room past the step's ``n`` tokens for the K/V of the drafts the runner chains after it (the next
        step's catch-up overwrites them), where free blocks allow: never at the price of a preemption."""
        if self.speculation(seq) != "mtp":
            return 0
        end = seq.num_computed_tokens + n
        want = max(0, min(self.cfg.num_speculative_tokens - 1, self.max_model_len - end))
        extra = self.kv.blocks_needed(end + want) - len(self.kv.block_table(seq.seq_id))
        return want if extra <= self.kv.num_free_blocks else 0

    def _record_speculation(self: Scheduler, seq: Sequence, tokens: list[int]) -> None:
        """A decoding sequence's step came back with ``tokens``: roll its computed tokens back to the accepted ones
        (the rejected drafts' K/V slots are garbage, overwritten by later steps) and count the drafts."""
        method = self.speculation(seq)
        if method == "off":  # (which, with async scheduling, may have the next step in flight already)
            return
        drafted = seq.num_computed_tokens - len(seq.token_ids)  # the step computed the last token + its drafts
        seq.num_computed_tokens = len(seq.token_ids) + len(tokens) - 1
        self.drafter.record(seq.seq_id, method, drafted, len(tokens))
