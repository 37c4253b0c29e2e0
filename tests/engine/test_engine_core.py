"""The engine core's boundary: requests arrive prepared (validated and hashed on the submitter's thread, never on the
engine thread), and each step leaves as one `StepOutputs` per sink, whose rows read back as the sequences' outputs."""
from __future__ import annotations

import queue

import pytest

from engine import SamplingParams
from engine.core.loop import EngineLoop
from engine.errors import PromptTooLongError, RequestRejected
from engine.outputs import FinishReason, StepOutputs
from engine.requests import EngineRequest

GREEDY = dict(temperature=0, ignore_eos=True)


def test_preparation_validates_and_hashes_so_the_core_does_neither(qwen3_llm, monkeypatch):
    engine = qwen3_llm.engine
    block_size = engine.cfg.block_size
    prompt = [(7 * i) % 500 + 1 for i in range(3 * block_size + 2)]
    request = engine.prepare(EngineRequest("prepared", prompt, SamplingParams(max_tokens=3, **GREEDY), "tenant"))
    assert len(request.block_hashes) == 3
    assert request.block_hashes == engine.scheduler.hasher.hashes(prompt, "tenant")  # the same chain either way
    with pytest.raises(RequestRejected, match="outside the vocabulary"):
        engine.prepare(EngineRequest("bad", [1, engine.model_cfg.vocab_size], SamplingParams()))
    with pytest.raises(PromptTooLongError):
        engine.prepare(EngineRequest("long", [1] * engine.max_model_len, SamplingParams()))

    def no_hashing(*args):
        raise AssertionError("the engine thread hashed a prepared prompt")

    monkeypatch.setattr(engine.scheduler.hasher, "extend", no_hashing)
    monkeypatch.setattr(engine.preparer, "validate", no_hashing)
    engine.add(request)
    assert engine.scheduler.sequences["prepared"].block_hashes == request.block_hashes
    monkeypatch.undo()
    while engine.has_unfinished_requests():
        engine.step()
    again = qwen3_llm.generate([prompt], SamplingParams(max_tokens=3, **GREEDY), cache_salt="tenant")[0]
    assert again.num_cached_tokens == 3 * block_size  # the prepared hashes found the blocks the first run cached


class _Sink:
    def __init__(self) -> None:
        self.items: queue.SimpleQueue = queue.SimpleQueue()

    def put(self, item) -> None:
        self.items.put(item)

    def rows(self, request_ids: set[str]) -> dict[str, list]:
        """Every output row per request until all of them finished; asserts each item is one step's columns."""
        got: dict[str, list] = {r: [] for r in request_ids}
        while any(not outs or not outs[-1].finished for outs in got.values()):
            item = self.items.get(timeout=120)
            assert isinstance(item, StepOutputs) and len({*item.request_ids} - request_ids) == 0
            for out in item:
                got[out.request_id].append(out)
        return got


@pytest.mark.slow
def test_each_step_reaches_each_sink_as_one_step_outputs(qwen3_llm):
    loop = EngineLoop(qwen3_llm.engine)
    loop.start()
    try:
        first, second = _Sink(), _Sink()
        loop.submit([EngineRequest("a", [11, 12, 13], SamplingParams(max_tokens=4, **GREEDY)),
                     EngineRequest("b", [14, 15], SamplingParams(max_tokens=6, n=2, seed=3, temperature=1.0))],
                    first).result(60)
        loop.submit([EngineRequest("c", [16, 17, 18, 19], SamplingParams(max_tokens=5, **GREEDY))], second).result(60)
        got, other = first.rows({"a", "b"}), second.rows({"c"})
    finally:
        loop.shutdown()
    assert sum(len(o.new_token_ids) for o in got["a"]) == 4 and got["a"][-1].finish_reason is FinishReason.LENGTH
    assert sorted(o.index for o in got["b"] if o.finished) == [0, 1]  # both siblings, each under its index
    assert sum(len(o.new_token_ids) for o in got["b"]) == 12
    assert sum(len(o.new_token_ids) for o in other["c"]) == 5 and other["c"][0].num_prompt_tokens == 4
    expected = qwen3_llm.generate([[16, 17, 18, 19]], SamplingParams(max_tokens=5, **GREEDY))[0].token_ids
    assert [t for o in other["c"] for t in o.new_token_ids] == expected
