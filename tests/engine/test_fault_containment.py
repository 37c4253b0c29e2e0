"""Fault containment in the engine thread: what one request carries fails that request alone (a seed the sampler
cannot take is refused at the boundary; a grammar that breaks inside a step ends its own request), while a fault of
the engine itself fails every request, stops the loop and shows in `alive` / `error` (what /health reports)."""
from __future__ import annotations

import json
import queue

import pytest

from engine import SamplingParams
from engine.core.loop import EngineLoop, EngineRequest
from engine.errors import EngineDeadError, RequestRejected
from engine.outputs import FinishReason
from engine.sampling_params import StructuredOutputSpec

GREEDY = dict(temperature=0.0, ignore_eos=True)
OBJECT = StructuredOutputSpec("json_schema", json.dumps({"type": "object"}))


def test_a_seed_beyond_64_bits_is_refused_at_the_boundary():
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2**64)
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=-(2**63) - 1)
    SamplingParams(seed=2**64 - 1)  # the largest a generator takes


def _collect(outputs: queue.SimpleQueue, request_ids: set[str], timeout: float = 120) -> dict[str, list]:
    """Every output per request until all of them finished (or the engine's error, raised)."""
    got: dict[str, list] = {r: [] for r in request_ids}
    open_ids = set(request_ids)
    while open_ids:
        item = outputs.get(timeout=timeout)
        if isinstance(item, BaseException):
            raise item
        for out in item:
            got[out.request_id].append(out)
            if out.finished:
                open_ids.discard(out.request_id)
    return got


@pytest.mark.slow
def test_a_grammar_that_breaks_in_a_step_ends_its_request_alone(qwen3_llm, monkeypatch):
    engine = qwen3_llm.engine
    grammars = engine.structured_outputs
    real_matcher = grammars._matcher

    def matcher(row):  # the grammar of request "victim" cannot be prepared inside the step
        if row.request_id == "victim" and row.request_id not in grammars._failed:
            grammars._failed[row.request_id] = "its grammar could not be prepared: injected"
            return None
        return real_matcher(row)

    monkeypatch.setattr(grammars, "_matcher", matcher)
    loop = EngineLoop(engine)
    loop.start()
    try:
        outputs: queue.SimpleQueue = queue.SimpleQueue()
        requests = [
            EngineRequest("victim", [11, 12, 13, 14, 15], SamplingParams(max_tokens=6, structured_output=OBJECT,
                                                                         **GREEDY)),
            EngineRequest("bystander", [21, 22, 23, 24, 25], SamplingParams(max_tokens=6, **GREEDY)),
            EngineRequest("constrained-bystander", [31, 32, 33], SamplingParams(max_tokens=6, structured_output=OBJECT,
                                                                                **GREEDY)),
        ]
        loop.submit(requests, outputs).result(timeout=60)
        got = _collect(outputs, {r.request_id for r in requests})
        victim = got["victim"][-1]
        assert victim.finish_reason is FinishReason.ERROR and "injected" in victim.error
        assert sum(len(o.new_token_ids) for o in got["bystander"]) == 6
        assert got["bystander"][-1].finish_reason is FinishReason.LENGTH
        assert got["constrained-bystander"][-1].finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
        assert got["constrained-bystander"][-1].error is None
        assert loop.alive and loop.error is None
    finally:
        loop.shutdown()


def test_a_failure_while_adding_a_request_fails_that_submission_alone(qwen3_llm, monkeypatch):
    engine = qwen3_llm.engine
    real_add = engine.add

    def add(request):
        if request.request_id == "broken":
            raise RuntimeError("injected while adding")
        return real_add(request)

    monkeypatch.setattr(engine, "add", add)
    loop = EngineLoop(engine)
    loop.start()
    try:
        outputs: queue.SimpleQueue = queue.SimpleQueue()
        bystander = EngineRequest("ok", [41, 42, 43], SamplingParams(max_tokens=4, **GREEDY))
        loop.submit([bystander], outputs).result(timeout=60)
        with pytest.raises(RuntimeError, match="injected"):
            loop.submit([EngineRequest("broken", [1, 2, 3], SamplingParams(max_tokens=4))], outputs).result(60)
        with pytest.raises(RequestRejected):
            loop.submit([EngineRequest("empty", [], SamplingParams(max_tokens=4))], outputs).result(60)
        got = _collect(outputs, {"ok"})
        assert sum(len(o.new_token_ids) for o in got["ok"]) == 4 and loop.alive
    finally:
        loop.shutdown()


def test_an_engine_fault_fails_everyone_and_the_loop_says_it_died(qwen3_llm, monkeypatch):
    engine = qwen3_llm.engine
    loop = EngineLoop(engine)
    deaths: list[BaseException] = []
    loop.on_death = deaths.append
    loop.start()
    try:
        outputs: queue.SimpleQueue = queue.SimpleQueue()
        monkeypatch.setattr(engine, "step", lambda: (_ for _ in ()).throw(RuntimeError("injected engine fault")))
        loop.submit([EngineRequest("a", [1, 2, 3], SamplingParams(max_tokens=4)),
                     EngineRequest("b", [4, 5, 6], SamplingParams(max_tokens=4))], outputs).result(timeout=60)
        with pytest.raises(EngineDeadError, match="injected engine fault"):
            _collect(outputs, {"a", "b"})
        loop._thread.join(30)
        assert not loop.alive and "injected engine fault" in repr(loop.error) and len(deaths) == 1
    finally:
        monkeypatch.undo()
        loop.shutdown()
    assert not engine.has_unfinished_requests()  # the loop aborted what it held: the shared engine is clean
