"""The scheduler's columnar fast path: many running sequences that each decode one token, scheduled and updated by
column arithmetic over the running columns (engine/sched/running_columns.py, engine/sched/step_state.py) instead of
one `Sequence` at a time.

`SteadyPath` is a part of `engine.sched.scheduler.Scheduler`, split off so that the scheduler's own module reads as
the algorithm: it uses the scheduler's running columns (``_running``), KV manager, outputs and counters, and hands
every sequence it cannot do in bulk (one that needs a block, fills one, finishes, is in its prompt) to the general
path (``_make_room``, ``_schedule``, ``_schedule_decodes_in_turn``, ``_commit``, ``_finish``). What it does is what
the general path does: tests/sched/test_steady_path.py runs both on the same random workloads and compares every
step.
"""
from __future__ import annotations

from collections import abc
from typing import TYPE_CHECKING

import numpy as np

from engine.outputs import FinishReason, SchedulerOutput
from engine.sched.running_columns import horizon_after
from engine.sched.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from engine.sched.scheduler import Scheduler

# Below this many decodes a step's per-sequence loops beat column arithmetic (numpy's fixed cost per call)
MIN_COLUMNAR_ROWS = 32


class SteadyPath:
    """Mixed into `Scheduler` (whose attributes it reads: see the module docstring)."""

    def _schedule_running_by_columns(self: Scheduler, budget: int, out: SchedulerOutput
                                     ) -> tuple[list[Sequence], int]:
        """The running sequences' lengths (known + in flight) and computed tokens as columns: the decodes are
        scheduled (`_schedule_decodes`), the prefills returned for the general path, with the budget left."""
        running = self.running
        state, entries = self._running.state, self._running.entries[: len(running)]
        lengths = state.num_known[entries] + state.num_placeholders[entries]
        computed = state.num_computed[entries]
        # (numpy calls kept few and plain: with the caches cold after a forward each costs microseconds)
        is_prefill = lengths - computed > 1
        decode_rows = np.flatnonzero(~is_prefill) if np.count_nonzero(is_prefill) else None  # None: all running
        prefills = [running[i] for i in np.flatnonzero(is_prefill).tolist()] if decode_rows is not None else []
        return prefills, self._schedule_decodes(decode_rows, lengths, computed, budget, out)

    def _schedule_decodes(self: Scheduler, rows: np.ndarray | None, lengths: np.ndarray, computed: np.ndarray, budget: int,
                          out: SchedulerOutput) -> int:
        """The running sequences with one token to compute and no drafts, the bulk of a step: rows ``rows`` of the
        running list (None: all), whose ``lengths`` (known tokens and those in flight) and ``computed`` tokens are
        given for every running sequence. A steady decode (below its horizon: engine/sched/running_columns.py) is scheduled in bulk by
        column arithmetic; the others take the general path one at a time. When blocks could run short, the general
        path runs in running order between runs of steady ones, so that a preemption picks the victims it would in
        one loop. Returns the budget left."""
        cols = self._running
        decodes = list(cols.seqs) if rows is None else [cols.seqs[i] for i in rows.tolist()]  # (a C-level copy)
        if len(decodes) > budget or len(decodes) < MIN_COLUMNAR_ROWS:
            # a budget that runs out among them, or too few for numpy to pay: one at a time
            return self._schedule_decodes_in_turn(decodes, budget, 0, out)
        if rows is None:  # every running sequence: the columns as they are
            rows = slice(0, len(decodes))
        else:
            lengths, computed = lengths[rows], computed[rows]
        max_tokens, horizon = cols.max_num_tokens[rows], cols.horizon[rows]
        todo = lengths < max_tokens  # else the tokens in flight reach max_tokens or the context length
        general = (lengths >= horizon) | (lengths - computed != 1)
        general &= todo
        steady = todo ^ general  # todo and not general
        general_rows = np.flatnonzero(general).tolist()
        first, start, version = len(out.seq_ids), 0, cols.version
        if general_rows:
            by_position = len(general_rows) > self.kv.num_free_blocks  # each needs at most one block
            horizons = []
            for i in general_rows:
                if by_position:
                    self._schedule_steady(rows, steady, lengths, computed, start, i, out)
                    start = i + 1
                seq, n = decodes[i], int(lengths[i] - computed[i])
                new_block_ids = self._make_room(seq, n, out)
                if new_block_ids is not None:
                    self._schedule(seq, n, new_block_ids, out)
                if cols.version != version:  # rows moved (a preemption, or one out of blocks): the rest one at a time
                    unscheduled = (np.flatnonzero(steady[start:i]) + start).tolist() + list(range(i + 1, len(decodes)))
                    return self._schedule_decodes_in_turn([decodes[j] for j in unscheduled],
                                                          budget - sum(out.num_new_tokens[first:]), 0, out)
                horizons.append(horizon_after(seq, self.kv.num_held_blocks(seq.seq_id), self.cfg.block_size))
            cols.horizon[general_rows if isinstance(rows, slice) else rows[general_rows]] = horizons
        self._schedule_steady(rows, steady, lengths, computed, start, len(decodes), out)
        return budget - sum(out.num_new_tokens[first:])

    def _schedule_steady(self: Scheduler, rows: slice | np.ndarray, steady: np.ndarray, lengths: np.ndarray,
                         computed: np.ndarray, start: int, end: int, out: SchedulerOutput) -> None:
        """The steady ones among decodes ``start:end`` (running rows ``rows[start:end]``), in bulk: what `_schedule`
        does for them (one token, which samples), on the columns alone."""
        if start == end:
            return
        cols = self._running
        picked = np.flatnonzero(steady[start:end]) + start
        if len(picked) == end - start:  # all of them
            picked = slice(start, end)
        running_rows = picked if isinstance(rows, slice) else rows[picked]  # (the slice is every running row)
        if isinstance(running_rows, slice):
            seq_ids = cols.seq_ids[running_rows]
        else:
            seq_ids = [cols.seq_ids[i] for i in running_rows.tolist()]
        count = len(seq_ids)
        out.seq_ids += seq_ids
        out.num_new_tokens += [1] * count
        out.num_computed_tokens += computed[picked].tolist()
        out.samples += [True] * count
        cols.state.scheduled(cols.entries[running_rows], lengths[picked])

    def _update_by_columns(self: Scheduler, runner_output, now: float) -> bool:
        """`update` by columns when the step sampled one plain token for each of many running sequences (no logprobs,
        drafts or grammar ends); False when it did not, and the general `update` must run."""
        if (runner_output.logprobs is not None or runner_output.emitted_token_ids is not None
                or runner_output.draft_token_ids is not None or self.num_speculative
                or len(runner_output.seq_ids) < MIN_COLUMNAR_ROWS):
            return False
        rows = self._rows_sampled(runner_output.seq_ids)
        if rows is None or self._running.num_prefill_only:
            return False
        self._update_steady(rows, runner_output.sampled_token_ids, now)
        return True

    def _rows_sampled(self: Scheduler, seq_ids: list[str]) -> np.ndarray | None:
        """The running rows of the sequences a step sampled for, in its order (kept while neither they nor the rows
        change); None when one of them is no longer running (finished or preempted after the step was scheduled)."""
        cached = self._sampled_rows
        if cached is None or cached[1] != self._running.version or cached[0] != seq_ids:
            rows = self._running.rows_of(seq_ids)
            if rows is None:
                return None
            self._sampled_rows = cached = (list(seq_ids), self._running.version, rows)
        return cached[2]

    def _update_steady(self: Scheduler, rows: np.ndarray, tokens: abc.Sequence[int], now: float) -> None:
        """`update` for a step that sampled one token per sequence (running rows ``rows``), with no logprobs, drafts
        or grammar ends (a steady decode): the tokens join the step state and the outputs as arrays, the finish checks
        are column arithmetic, and only the sequences that fill a block, finish, give their first output or have
        their recent tokens' room full are visited one by one."""
        cols = self._running
        # (numpy calls kept few: with the caches cold after a forward each costs microseconds)
        in_order = len(rows) == len(cols) and cols.seq_ids == self._sampled_rows[0]  # rows 0, 1, 2, ...
        picked = slice(0, len(rows)) if in_order else rows
        token_column = np.asarray(tokens, dtype=np.int64)
        lengths = cols.state.append(cols.entries[picked], token_column)
        stops = None
        for eos in self.eos_token_ids:
            stops = token_column == eos if stops is None else stops | (token_column == eos)
        if stops is None:
            stops = np.zeros(len(rows), dtype=bool)
        elif stops.any():
            stops &= ~cols.ignore_eos[picked]
        if cols.num_with_stop_token_ids:
            stop_token_ids = cols.stop_token_ids
            stops |= np.array([token in stop_token_ids[row] for token, row in zip(token_column.tolist(), rows.tolist())],
                              dtype=bool)
        too_long = lengths >= cols.max_num_tokens[picked]  # max_tokens, or the context length
        visit = stops | too_long
        fills_block = None
        if self.cfg.enable_prefix_caching:
            fills_block = lengths % self.cfg.block_size == 0
            visit |= fills_block
        outputs = self._outputs
        if in_order:
            infos = cols.infos
            first_row = outputs.extend(cols.request_ids, cols.indices, token_column, infos)
        else:
            row_list = rows.tolist()
            infos = [cols.infos[i] for i in row_list]
            first_row = outputs.extend([cols.request_ids[i] for i in row_list], [cols.indices[i] for i in row_list],
                                       token_column, infos)
        if cols.num_without_info and None in infos:  # first outputs (`SequenceInfo` compares by identity: C speed)
            self._first_outputs(rows, first_row, now)
        visited = np.flatnonzero(visit).tolist()
        seqs = cols.seqs
        for i, seq in [(i, seqs[int(rows[i])]) for i in visited]:  # (finishes move the rows)
            if fills_block is not None and fills_block[i]:
                self.hasher.extend(seq.block_hashes, seq.token_ids, seq.cache_salt)
                if seq.status is SequenceStatus.RUNNING:  # (not preempted with this token in flight)
                    self._commit(seq)
            reason = FinishReason.STOP if stops[i] else FinishReason.LENGTH if too_long[i] else None
            if reason is not None:
                outputs.finish_reasons[first_row + i] = reason
                stats = self.drafter.request_stats.get(seq.seq_id)
                if stats is not None:
                    outputs.speculation[first_row + i] = stats
                self._finish(seq, reason)
        self.num_decode_steps += len(rows)
        self.num_generation_tokens += len(rows)

    def _first_outputs(self: Scheduler, rows: np.ndarray, first_row: int, now: float) -> None:
        """The sequences among running rows ``rows`` (output rows ``first_row`` on) that gave their first output:
        their info, first-token time and prompt logprobs."""
        cols, outputs = self._running, self._outputs
        for i, row in enumerate(rows.tolist()):
            if cols.infos[row] is not None:
                continue
            seq = cols.seqs[row]
            if seq.timings.first_token is None:
                seq.timings.first_token = now
            info = seq.info or self._info(seq)
            cols.set_info(row, info)
            outputs.infos[first_row + i] = info
            if seq.prompt_logprobs is not None:  # with the first token
                outputs.prompt_logprobs[first_row + i], seq.prompt_logprobs = seq.prompt_logprobs, None
