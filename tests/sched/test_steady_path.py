"""The scheduler's columnar steady-decode path (engine/sched/running_columns.py, engine/sched/step_state.py) against its
one-sequence-at-a-time loop, on the same staggered workload, step by step: what is scheduled, the blocks each sequence
gains, preemptions and every output, with each step's tokens back at once or after the next step was scheduled (async
scheduling). Driven without a model."""
from __future__ import annotations

import numpy as np
import pytest

import engine.sched.scheduler as scheduler_module
import engine.sched.step_state as step_state
from engine.config import EngineConfig
from engine.outputs import ModelRunnerOutput
from engine.sampling_params import SamplingParams
from engine.kv.block_hashing import BlockHasher
from engine.kv.layout import KVLayout
from engine.sched.scheduler import Scheduler

EOS = 2
STOP = 3


def token_for(seq_id: str, length: int) -> int:
    """A token that depends on the sequence and its length: now and then EOS or the stop token."""
    return 2 + (sum(map(ord, seq_id)) * 31 + length * 7) % 61


def run(num_blocks: int, columnar: bool, monkeypatch: pytest.MonkeyPatch, overlap: bool = False) -> list[tuple]:
    """``overlap``: each step's tokens come back after the next step was scheduled (async scheduling)."""
    monkeypatch.setattr(scheduler_module, "MIN_COLUMNAR_ROWS", 8 if columnar else 10**9)
    monkeypatch.setattr(step_state, "RECENT_TOKENS", 2)  # the step state's room for tokens fills now and then
    cfg = EngineConfig(block_size=4, device="cpu", max_num_batched_tokens=256, max_num_seqs=40)
    s = Scheduler(cfg, KVLayout(num_blocks), BlockHasher(cfg.block_size, "m"), max_model_len=1024, eos_token_ids={EOS})
    for i in range(40):
        prompt = [10 + (i * j) % 50 for j in range(5 + i % 7)]  # lengths 5-11: the batch crosses blocks unevenly
        s.add_request(f"r{i}", prompt, SamplingParams(max_tokens=6 + (i * 5) % 30, temperature=0, n=2 if i % 9 == 0
                                                      else 1, ignore_eos=i % 4 == 0,
                                                      stop_token_ids=[STOP] if i % 3 == 0 else []))
    steps, in_flight, delivered = [], None, {}
    while s.has_unfinished_requests() or in_flight is not None:
        out = s.schedule()
        sampled = [seq_id for seq_id, samples in zip(out.seq_ids, out.samples) if samples]
        if overlap:  # collect the step before
            in_flight, sampled = sampled or None, in_flight
        if sampled:
            known = {seq.seq_id: seq.num_known_tokens for seq in s.sequences.values()}
            s.update(ModelRunnerOutput(sampled, np.array([token_for(x, known.get(x, 0)) for x in sampled])))
        outputs = s.take_outputs()
        steps.append((sorted(zip(out.seq_ids, out.num_new_tokens, out.num_computed_tokens, out.samples)),
                      sorted((seq_id, len(ids)) for seq_id, ids in out.new_block_ids.items()),
                      sorted(out.preempted_seq_ids), sorted(out.finished_seq_ids),
                      sorted((o.request_id, o.index, o.new_token_ids, o.finish_reason) for o in outputs)))
        s.kv.check_invariants()
        for o in outputs:
            delivered.setdefault((o.request_id, o.index), []).extend(o.new_token_ids)
        for seq in s.sequences.values() if len(steps) % 5 == 0 else ():  # (reading a list brings it up to date)
            assert seq.output_token_ids == delivered.get((seq.request_id, seq.index), [])  # every token, in order
            assert len(seq.token_ids) == seq.num_known_tokens
        assert len(steps) < 1000
    return steps


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("num_blocks", [400, 40], ids=["roomy", "preempting"])
def test_columnar_decodes_match_the_loop(num_blocks: int, overlap: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    loop = run(num_blocks, columnar=False, monkeypatch=monkeypatch, overlap=overlap)
    columnar = run(num_blocks, columnar=True, monkeypatch=monkeypatch, overlap=overlap)
    assert columnar == loop
    assert any(finished for *_, finished, _ in loop)  # sequences finish along the way (the rows move)
    if num_blocks == 40:
        assert any(preempted for _, _, preempted, _, _ in loop)
