"""The model runner's persistent view of the sequences it computes, updated from `SchedulerOutput` deltas.

Each sequence the runner knows has a `RunnerSequence` (sampling state, block table, and its tokens while it has no
row), kept from its first step until it finishes, across preemptions. The sequences scheduled in a step occupy the
rows ``0..num_rows-1`` of `InputBatch`, whose numpy arrays hold, per row, its token ids and its block table. While a
sequence has a row, sampled tokens are appended to the row only (one vectorized write per step); its
`RunnerSequence.token_ids` is brought up to date when the row goes. A row keeps its place while its sequence keeps
being scheduled, so a steady decode batch changes nothing but one token and, every ``block_size`` steps, one block
id per row: per-step host work grows with the tokens scheduled, not with context length.

Every change to a row's block table is also recorded as a (row, column, block id) triple; the runner ships the
triples to the device copy of the table once per step. A sliding-window model with a window group has a second
table per row, its window pages (`engine.kv.window_pool`), in the columns after the first table's
(``window_offset`` on): one table, one set of deltas, two views.
"""
from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.sampling_params import SamplingParams


@dataclass
class RunnerSequence:
    seq_id: str
    token_ids: list[int]  # prompt + the outputs whose sampled ids reached the host (while rowless; see above)
    params: SamplingParams
    generator: torch.Generator | None
    block_ids: list[int] = field(default_factory=list)
    window_block_ids: list[int] = field(default_factory=list)  # sliding-window models: its window pages
    state_row: int = -1  # hybrid models: the recurrent-state row it runs in
    output_counts: torch.Tensor | None = None  # [V] on the device: penalties only
    prompt_seen: torch.Tensor | None = None  # [V] bool: repetition penalty only


class InputBatch:
    def __init__(self, max_rows: int, max_model_len: int, max_blocks_per_row: int, window_table: bool = False) -> None:
        """``window_table``: each row has a window table too (columns ``window_offset`` on)."""
        self.max_rows = max_rows
        self.seq_ids: list[str] = []  # the sequence in each row
        self.sequences: list[RunnerSequence] = []
        self.row_of: dict[str, int] = {}
        self.token_ids = np.zeros((max_rows, max_model_len), dtype=np.int32)
        self.num_known = np.zeros(max_rows, dtype=np.int32)  # token ids of the row present in token_ids
        self.window_offset = max_blocks_per_row if window_table else 0
        self.block_table = np.zeros((max_rows, max_blocks_per_row * (2 if window_table else 1)), dtype=np.int32)
        self.num_blocks = np.zeros(max_rows, dtype=np.int32)
        self.num_window_blocks = np.zeros(max_rows, dtype=np.int32)
        self.state_rows = np.zeros(max_rows, dtype=np.int32)  # hybrid models: each row's recurrent-state row
        self.num_computed = np.zeros(max_rows, dtype=np.int32)
        self.num_new = np.zeros(max_rows, dtype=np.int32)  # tokens scheduled this step
        self.samples = np.zeros(max_rows, dtype=bool)  # the row's chunk this step ends at its last token
        # speculative decoding: drafts scheduled after the row's last token, written past its known tokens
        self.num_drafts = np.zeros(max_rows, dtype=np.int32)
        # Where the row's last sampled token sits in the previous step's device output: with async scheduling its
        # id is not on the host yet when the next step is prepared, so the device copies it into the inputs.
        self.pending_src = np.zeros(max_rows, dtype=np.int32)
        self.steps_unrecorded = 0  # sampling steps launched whose ids are not appended yet (0: no token is pending)
        # 0, 1, 2, ...: views of these are steps' inputs (int32, shipped) and row indexes (intp, on the host)
        self.row_numbers = np.arange(max_rows + 1, dtype=np.int32)
        self.row_index = np.arange(max_rows, dtype=np.intp)
        self.version = 0  # changes whenever rows are added, removed or moved
        # every block-table change since the last step: rows, columns, block ids (plain lists: a step where every
        # row crosses a block boundary appends one entry per row)
        self._delta_rows: list[int] = []
        self._delta_cols: list[int] = []
        self._delta_ids: list[int] = []

    @property
    def num_rows(self) -> int:
        return len(self.seq_ids)

    def add(self, seq: RunnerSequence) -> int:
        row = len(self.seq_ids)
        self.seq_ids.append(seq.seq_id)
        self.sequences.append(seq)
        self.row_of[seq.seq_id] = row
        self._fill(row, seq)
        self.version += 1
        return row

    def _fill(self, row: int, seq: RunnerSequence) -> None:
        n = len(seq.token_ids)
        self.token_ids[row, :n] = seq.token_ids
        self.num_known[row] = n
        self.state_rows[row] = seq.state_row
        self.num_blocks[row] = 0
        self.append_blocks(row, seq.block_ids)
        self.num_window_blocks[row] = 0
        self.append_window_blocks(row, seq.window_block_ids)

    def remove_all_but(self, keep: set[str], finished: Collection[str] = ()) -> None:
        """Drop the rows of sequences not scheduled this step; move the last rows into the holes. The tokens of a
        dropped row go back to its `RunnerSequence`, unless its sequence is ``finished`` (nothing will read them)."""
        if self.row_of.keys() == keep:  # the same sequences as last step
            return
        self.version += 1
        for row, seq_id in enumerate(self.seq_ids):
            if seq_id not in keep and seq_id not in finished:
                self._take_tokens_back(row)
        kept = [r for r in self.seq_ids if r in keep]
        holes = [i for i, r in enumerate(self.seq_ids[: len(kept)]) if r not in keep]
        movers = [i for i in range(len(kept), len(self.seq_ids)) if self.seq_ids[i] in keep]
        for dst, src in zip(holes, movers):
            self._move(src, dst)
        for seq_id in self.seq_ids[len(kept):]:
            if self.row_of.get(seq_id, -1) >= len(kept):
                del self.row_of[seq_id]
        del self.seq_ids[len(kept):]
        del self.sequences[len(kept):]

    def _take_tokens_back(self, row: int) -> None:
        """The row is going: its sequence's tokens move back to its `RunnerSequence`."""
        self.sequences[row].token_ids = self.token_ids[row, : self.num_known[row]].tolist()

    def _move(self, src: int, dst: int) -> None:
        seq_id = self.seq_ids[src]
        dropped = self.seq_ids[dst]
        if self.row_of.get(dropped) == dst:
            del self.row_of[dropped]
        self.seq_ids[dst] = seq_id
        self.sequences[dst] = self.sequences[src]
        self.row_of[seq_id] = dst
        n, b = self.num_known[src], self.num_blocks[src]
        self.token_ids[dst, :n] = self.token_ids[src, :n]
        self.num_known[dst] = n
        self.pending_src[dst] = self.pending_src[src]
        self.state_rows[dst] = self.state_rows[src]
        self.num_blocks[dst] = 0
        self.append_blocks(dst, self.block_table[src, :b].tolist())
        if self.window_offset:
            w, offset = self.num_window_blocks[src], self.window_offset
            self.num_window_blocks[dst] = 0
            self.append_window_blocks(dst, self.block_table[src, offset : offset + w].tolist())

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        if block_ids:
            self.num_blocks[row] = self._append(row, int(self.num_blocks[row]), block_ids)

    def append_window_blocks(self, row: int, page_ids: list[int]) -> None:
        """Sliding-window models: window pages at the end of the row's window table."""
        if page_ids:
            offset = self.window_offset
            self.num_window_blocks[row] = self._append(row, offset + int(self.num_window_blocks[row]), page_ids) - offset

    def _append(self, row: int, start: int, ids: list[int]) -> int:
        end = start + len(ids)
        self.block_table[row, start:end] = ids
        self._delta_rows += [row] * len(ids)
        self._delta_cols += range(start, end)
        self._delta_ids += ids
        return end

    def append_tokens(self, rows: np.ndarray | list[int], tokens: np.ndarray | list[int]) -> None:
        """One token each at the end of the rows' known tokens (rows distinct; an intp array is the fast index)."""
        self.token_ids[rows, self.num_known[rows]] = tokens
        self.num_known[rows] += 1

    def set_drafts(self, row: int, drafts: list[int]) -> None:
        """The row's drafts for this step, after its known tokens (they become known only once accepted)."""
        known = int(self.num_known[row])
        self.token_ids[row, known : known + len(drafts)] = drafts
        self.num_drafts[row] = len(drafts)

    def drafts(self, row: int) -> list[int]:
        known = int(self.num_known[row])
        return self.token_ids[row, known : known + int(self.num_drafts[row])].tolist()

    def append_token_lists(self, rows: list[int], tokens: list[list[int]]) -> None:
        """Several tokens per row (speculative decoding: accepted drafts and the target's token)."""
        for row, row_tokens in zip(rows, tokens):
            known = int(self.num_known[row])
            self.token_ids[row, known : known + len(row_tokens)] = row_tokens
            self.num_known[row] = known + len(row_tokens)

    def take_block_table_deltas(self) -> np.ndarray:
        """``[3, D]`` int32 (rows, columns, block ids) of every table change since the last call."""
        if not self._delta_rows:
            return np.zeros((3, 0), dtype=np.int32)
        deltas = np.array([self._delta_rows, self._delta_cols, self._delta_ids], dtype=np.int32)
        self._delta_rows, self._delta_cols, self._delta_ids = [], [], []
        return deltas
