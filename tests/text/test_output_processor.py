"""`OutputProcessor` over whole steps, as the engine delivers them: many sequences per `StepOutputs`, sharing the
processor's single-token texts, streamed (a server's streams) or with the text made once at the end
(``final_text_only``, the offline API). Both give every sequence the text its tokens decode to after the prompt,
and stop strings cut the same place either way."""
from __future__ import annotations

import numpy as np
import pytest

from engine.outputs import FinishReason, RequestTimings, SequenceInfo, StepOutputs
from engine.sampling_params import SamplingParams
from engine.text.output_processor import CompletionOutput, OutputProcessor
from tests.text.test_detokenizer import SAMPLES, _get


def _run(name: str, final_text_only: bool, stop: list[str] | None = None) -> tuple[dict, dict, dict]:
    """Every sample as one sequence's output after a prompt (skip_special_tokens alternating, a special token inside
    some), all sequences in lockstep, one step per token; the last step finishes each with LENGTH."""
    t = _get(name)
    prompt = t.encode("Once upon a time, ")
    outputs = {f"r{i}": t.encode(text) + ([t.special_id] + t.encode(" tail") if i % 3 == 0 else [])
               for i, text in enumerate(SAMPLES)}
    skip = {rid: i % 2 == 0 for i, rid in enumerate(outputs)}
    processor = OutputProcessor(t.tokenizer, final_text_only=final_text_only)
    for rid in outputs:
        processor.add_request(rid, prompt, SamplingParams(max_tokens=100, skip_special_tokens=skip[rid], stop=stop or []))
    texts = {rid: CompletionOutput() for rid in outputs}
    info = SequenceInfo(len(prompt), 0, 0, 0, RequestTimings(0.0))
    deltas: dict[str, list[str]] = {rid: [] for rid in outputs}
    for k in range(max(map(len, outputs.values()))):
        step = StepOutputs()
        live = [rid for rid, ids in outputs.items() if k < len(ids) - 1]
        step.extend(live, [0] * len(live), np.array([outputs[rid][k] for rid in live], dtype=np.int64), [info] * len(live))
        for rid in (rid for rid, ids in outputs.items() if k == len(ids) - 1):
            step.add(rid, 0, [outputs[rid][k]], info, FinishReason.LENGTH)
        delivered, _ = processor.process(list(step))
        for out in delivered:
            texts[out.request_id].add(out)
            deltas[out.request_id].append(out.new_text)
    expected = {rid: t.decode(prompt + ids, skip_special_tokens=skip[rid])[len(t.decode(prompt, skip[rid])):]
                for rid, ids in outputs.items()}
    return {rid: c.text for rid, c in texts.items()}, expected, deltas


@pytest.mark.parametrize("name", ["qwen", "deepseek", "llama-style"])
@pytest.mark.fast_cases("llama-style")  # the real tokenizers load in seconds
def test_streamed_and_final_text_are_the_decode_of_each_output(name: str) -> None:
    streamed, expected, deltas = _run(name, final_text_only=False)
    final, _, final_deltas = _run(name, final_text_only=True)
    assert streamed == expected and final == expected
    assert sum(1 for d in deltas.values() if sum(1 for x in d if x) > 1) >= len(SAMPLES) // 2  # really streamed
    assert all(not any(d[:-1]) for d in final_deltas.values())  # ... and really made once, in the last output


def test_stop_strings_cut_the_same_with_final_text_only() -> None:
    stop = ["o", "世界"]
    streamed, expected, _ = _run("llama-style", final_text_only=False, stop=stop)
    final, _, _ = _run("llama-style", final_text_only=True, stop=stop)
    assert final == streamed
    cut = {rid: min([i for i in (e.find(s) for s in stop) if i >= 0], default=len(e)) for rid, e in expected.items()}
    assert streamed == {rid: e[: cut[rid]] for rid, e in expected.items()}
    assert sum(cut[rid] < len(e) for rid, e in expected.items()) >= 5
