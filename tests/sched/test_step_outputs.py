"""`StepOutputs`' token columns: rows added one at a time (general path) and in bulk (a steady decode's array) keep
their order, and a client's share of a step (`select`) keeps each row's tokens, however many it has."""
from __future__ import annotations

import numpy as np

from engine.core.wire import StepDecoder, StepEncoder
from engine.outputs import FinishReason, RequestTimings, SequenceInfo, StepOutputs


def _info() -> SequenceInfo:
    return SequenceInfo(4, 0, 0, 0, RequestTimings(1.0))


def _step() -> StepOutputs:
    out = StepOutputs()
    out.add("a", 0, [7, 8, 9], _info())  # a speculative row: accepted drafts and the model's own token
    first = out.extend(["b", "c", "d"], [0, 0, 1], np.array([11, 12, 13]), [_info()] * 3)
    out.add("e", 0, [], _info(), FinishReason.ERROR)  # ended without a token
    out.finish_reasons[first + 1] = FinishReason.STOP
    out.extend(["f"], [0], np.array([14]), [_info()])
    return out


def test_rows_keep_their_tokens_in_order() -> None:
    out = _step()
    assert [(o.request_id, o.index, o.new_token_ids) for o in out] == [
        ("a", 0, [7, 8, 9]), ("b", 0, [11]), ("c", 0, [12]), ("d", 1, [13]), ("e", 0, []), ("f", 0, [14])]
    assert out.token_ids.tolist() == [7, 8, 9, 11, 12, 13, 14] and out.num_tokens.tolist() == [3, 1, 1, 1, 0, 1]
    assert [o.finish_reason for o in out] == [None, None, FinishReason.STOP, None, FinishReason.ERROR, None]


def test_a_selection_keeps_each_rows_tokens_and_sparse_columns() -> None:
    picked = _step().select([4, 2, 0, 5])
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in picked] == [
        ("e", [], FinishReason.ERROR), ("c", [12], FinishReason.STOP), ("a", [7, 8, 9], None), ("f", [14], None)]


def test_the_token_columns_cross_as_bytes() -> None:
    fields = StepEncoder(lambda request_id: True).encode(_step())
    assert isinstance(fields[2], bytes) and isinstance(fields[3], bytes)
    decoded = StepDecoder().decode(fields)
    assert [o.new_token_ids for o in decoded] == [o.new_token_ids for o in _step()]


def test_a_plain_steps_rows_read_at_once_equal_its_rows_read_one_by_one() -> None:
    """A step whose rows carry only tokens and finish reasons is read in one pass (`StepOutputs.__iter__`); with an
    error, logprobs or speculation it is read row by row. Both give the same outputs."""
    for one_token_each in (True, False):
        out = StepOutputs()
        if not one_token_each:
            out.add("a", 0, [7, 8, 9], _info())
        first = out.extend(["b", "c", "d"], [0, 0, 1], np.array([11, 12, 13]), [_info()] * 3)
        out.finish_reasons[first + 1] = FinishReason.LENGTH
        assert not (out.errors or out.logprobs or out.speculation)
        assert list(out) == [out.output(row) for row in range(len(out))]
        assert [o.new_token_ids for o in out][-3:] == [[11], [12], [13]]
