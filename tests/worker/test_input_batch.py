"""`InputBatch`: while a sequence has a row its sampled tokens live in the row only; they go back to its
`RunnerSequence` when the row goes, so a sequence that comes back (unscheduled for a step, preempted) resumes from
every token it had."""
from __future__ import annotations

import numpy as np

from engine.worker.input_batch import InputBatch, RunnerSequence
from engine.sampling_params import SamplingParams


def _sequence(seq_id: str, prompt: list[int]) -> RunnerSequence:
    return RunnerSequence(seq_id, list(prompt), SamplingParams(), None, block_ids=[len(prompt)])


def _row_tokens(batch: InputBatch, seq_id: str) -> list[int]:
    row = batch.row_of[seq_id]
    return batch.token_ids[row, : batch.num_known[row]].tolist()


def test_tokens_follow_rows_that_leave_move_and_come_back() -> None:
    batch = InputBatch(max_rows=4, max_model_len=32, max_blocks_per_row=4)
    a, b, c = _sequence("a", [1, 2]), _sequence("b", [3]), _sequence("c", [4, 5, 6])
    for req in (a, b, c):
        batch.add(req)
    batch.append_tokens(np.array([0, 1, 2]), [10, 20, 30])
    batch.append_tokens([0, 2], [11, 31])
    assert a.token_ids == [1, 2] and _row_tokens(batch, "a") == [1, 2, 10, 11]  # the row holds the new tokens

    batch.remove_all_but({"b", "c"})  # "a" goes; "c" moves into its row
    assert a.token_ids == [1, 2, 10, 11]
    assert batch.row_of == {"c": 0, "b": 1} and _row_tokens(batch, "c") == [4, 5, 6, 30, 31]
    assert [r.seq_id for r in batch.sequences] == batch.seq_ids == ["c", "b"]

    batch.add(a)  # back, with every token it had
    assert _row_tokens(batch, "a") == [1, 2, 10, 11] and batch.block_table[batch.row_of["a"], 0] == 2
    batch.remove_all_but(set())
    assert (a.token_ids, b.token_ids, c.token_ids) == ([1, 2, 10, 11], [3, 20], [4, 5, 6, 30, 31])
    assert batch.num_rows == 0 and batch.row_of == {}
