"""The scheduler's running sequences, in admission order, with columns: what a steady decode step needs to decide which
sequences take the scheduler's general path, and to report their outputs, without visiting each sequence.

Each row keeps what does not change while its sequence runs (ids, limits, stop conditions) and the sequence's
*horizon*: the length (known tokens and those in flight) from which the steady rule (one token, into a block with
room, filling none) no longer holds: its next block boundary, or one past what its blocks hold, or 0 while it is
still in its prompt or has siblings to queue (and on arrival: the general path then sets it). A steady decode grows
by one token a step until it reaches its horizon; the general path then schedules it and sets its next one
(`horizon_after`). A horizon can only be too low (blocks are only added while a sequence runs, siblings only ever
leave), which sends a sequence the general way once more, never the steady way wrongly. What changes every step
(known tokens, tokens in flight, computed tokens, the newest tokens) is in ``state`` (engine/sched/step_state.py), at the
entry ``entries[row]`` while the sequence runs.

Rows follow the running list as it changes (`append`, `remove`), so a batch that changes by a few sequences costs a few
row moves, never a rebuild.
"""
from __future__ import annotations

import numpy as np

from engine.outputs import SequenceInfo
from engine.sched.sequence import Sequence
from engine.sched.step_state import StepState


class RunningColumns:
    def __init__(self, capacity: int) -> None:
        self.seqs: list[Sequence] = []  # the running list itself (the scheduler's `running`)
        self.seq_ids: list[str] = []
        self.request_ids: list[str] = []
        self.indices: list[int] = []
        self.infos: list[SequenceInfo | None] = []  # None until the sequence's first output
        self.num_without_info = 0
        self.stop_token_ids: list[list[int]] = []
        self.num_with_stop_token_ids = 0
        self.max_num_tokens = np.zeros(capacity, dtype=np.int64)  # prompt + max_tokens, capped by the context length
        self.horizon = np.zeros(capacity, dtype=np.int64)
        self.num_prefill_only = 0  # running sequences with max_tokens 0
        self.ignore_eos = np.zeros(capacity, dtype=bool)
        self.state = StepState(capacity)
        self.entries = np.zeros(capacity, dtype=np.intp)  # each row's entry in ``state``
        self.version = 0  # changes whenever a row comes, goes or moves

    def __len__(self) -> int:
        return len(self.seqs)

    def append(self, seq: Sequence) -> None:
        row = len(self.seqs)
        if row == len(self.horizon):  # more running sequences than planned for: grow
            for name in ("max_num_tokens", "horizon", "ignore_eos", "entries"):
                setattr(self, name, np.concatenate([getattr(self, name), np.zeros_like(getattr(self, name))]))
        params = seq.params
        self.seqs.append(seq)
        self.seq_ids.append(seq.seq_id)
        self.request_ids.append(seq.request_id)
        self.indices.append(seq.index)
        self.infos.append(seq.info)
        self.num_without_info += seq.info is None
        self.stop_token_ids.append(params.stop_token_ids)
        self.num_with_stop_token_ids += bool(params.stop_token_ids)
        self.max_num_tokens[row] = seq.max_num_tokens
        self.horizon[row] = 0
        self.num_prefill_only += params.max_tokens == 0
        self.ignore_eos[row] = params.ignore_eos
        self.entries[row] = self.state.attach(seq)
        self.version += 1

    def remove(self, seq: Sequence) -> None:
        row = self.seqs.index(seq)
        n = len(self.seqs)
        self.num_without_info -= self.infos[row] is None
        for column in (self.seqs, self.seq_ids, self.request_ids, self.indices, self.infos, self.stop_token_ids):
            del column[row]
        self.num_with_stop_token_ids -= bool(seq.params.stop_token_ids)
        self.num_prefill_only -= seq.params.max_tokens == 0
        self.state.detach(seq)
        for array in (self.max_num_tokens, self.horizon, self.ignore_eos, self.entries):
            array[row : n - 1] = array[row + 1 : n]
        self.version += 1

    def set_info(self, row: int, info: SequenceInfo) -> None:
        self.num_without_info -= self.infos[row] is None
        self.infos[row] = info

    def rows_of(self, seq_ids: list[str]) -> np.ndarray | None:
        """The rows of ``seq_ids`` (None when one is not running)."""
        row_of = {seq_id: row for row, seq_id in enumerate(self.seq_ids)}
        rows = [row_of.get(seq_id) for seq_id in seq_ids]
        return None if None in rows else np.array(rows, dtype=np.intp)


def horizon_after(seq: Sequence, num_blocks: int, block_size: int) -> int:
    """The horizon of ``seq``, which the general path just scheduled, from the next step on."""
    length, computed = seq.num_tokens, seq.num_computed_tokens
    if length - computed != 1 or computed < seq.num_prompt_tokens or seq.pending_siblings:
        return 0
    return min(-(-length // block_size) * block_size, num_blocks * block_size + 1)
