"""The engine core process's step messages (engine/core/wire.py): a step's outputs come back as they left, a
sequence's info travelling with its first and last rows only, and neither side keeps a sequence once it ended."""
from __future__ import annotations

import dataclasses

from engine.core.api import EngineFacts
from engine.core.wire import StepDecoder, StepEncoder, decode_facts, decode_request, encode_facts, encode_request, pack, \
    unpack
from engine.kv.window_pool import WindowBudget
from engine.outputs import DraftStats, FinishReason, RequestTimings, SequenceInfo, StepOutputs, TokenLogprobs
from engine.requests import EngineRequest
from engine.phase_budget import PhaseBudget
from engine.retention import CachePin, Retention
from engine.sampling_params import SamplingParams, StructuredOutputSpec


def _info(prompt: int) -> SequenceInfo:
    return SequenceInfo(prompt, 8, 4, 0, RequestTimings(10.0 + prompt, 10.5 + prompt, None, None), prompt // 2)


def _fields(out: StepOutputs) -> list:
    return [(o.request_id, o.index, o.new_token_ids, o.new_logprobs, o.finish_reason, o.error, o.num_prompt_tokens,
             o.num_cached_tokens, o.num_host_cached_tokens, o.timings, o.speculation, o.num_pinned_tokens) for o in out]


def test_steps_round_trip_and_infos_travel_with_first_and_last_rows_only() -> None:
    live = {"a", "b", "c"}
    encoder, decoder = StepEncoder(live.__contains__), StepDecoder()
    infos = {("a", 0): _info(11), ("a", 1): _info(11), ("b", 0): _info(23), ("c", 0): _info(5)}
    first = StepOutputs()
    for request_id, index in infos:
        first.add(request_id, index, [100 + index], infos[request_id, index])
    first.logprobs[0] = [TokenLogprobs(100, -0.5, [(100, -0.5), (7, -1.5)])]
    steady = StepOutputs()
    for request_id, index in infos:
        infos[request_id, index].timings.first_token = 11.0
        steady.add(request_id, index, [200, 201] if request_id == "b" else [200], infos[request_id, index])
    steady.speculation[1] = DraftStats(1, 2, 1, 3, 1)
    last = StepOutputs()
    infos["a", 1].timings.finished = 12.0
    last.add("a", 1, [300], infos["a", 1], FinishReason.STOP)
    last.add("b", 0, [], infos["b", 0], FinishReason.ERROR)
    last.errors[1] = "out of KV blocks"
    messages = [unpack(pack(["step", 1, encoder.encode(out)])) for out in (first, steady, last)]
    for out, message in zip((first, steady, last), messages):
        assert _fields(decoder.decode(message[2])) == _fields(out)
    info_rows = [message[2][4] for message in messages]
    assert info_rows[0] and info_rows[1] == b"" and info_rows[2]  # a steady decode row carries its tokens alone
    assert decoder.infos.keys() == encoder.known.keys() == {"a", "c"} and set(decoder.infos["a"]) == {0}
    live.clear()  # "a" 0 and "c" were aborted: they end without a last row
    for _ in range(StepEncoder.PRUNE_EVERY):
        decoder.decode(encoder.encode(StepOutputs()))
    assert encoder.known == {} and decoder.infos == {}


def test_a_prepared_request_crosses_whole() -> None:
    request = EngineRequest("r1", [1, 2, 151_000], SamplingParams(
        max_tokens=5, temperature=0.5, seed=2**64 - 1, stop=["\n\n"], logprobs=2,
        structured_output=StructuredOutputSpec("regex", "[a-z]+"),
        phase_budget=PhaseBudget(64, (11, 12, 9), (9,), (7,), True)), "salt",
        Retention((CachePin(4, 30.0),), 2.0, (8,), "tenant-a"), [b"\x01" * 16])
    assert decode_request(unpack(pack(encode_request(request)))) == request


def test_engine_facts_cross_whole_with_a_window_budget() -> None:
    """The facts the core process sends at start: a sliding-window model's WindowBudget arrives as one (the server's
    preparer asks it why a request can never fit), not as the dict msgpack carried."""
    budget = WindowBudget(window=12, block_size=4, num_pages=6, max_step_tokens=64)
    facts = EngineFacts(model_id="m", vocab_size=10, max_model_len=128, block_size=4, num_blocks=32,
                        prefix_caching=True, is_hybrid=False, tool_call_ttl=1.0, speculation_refused=None, mtp=False,
                        eos_token_ids=(2,), kv_cache_kind="paged", kv_bytes_per_token=64, rank_memory=("rank 0",),
                        kv_events_endpoint=None, kv_events_replay_endpoint=None, kv_events_topic="",
                        window_budget=budget)
    for sent in (facts, dataclasses.replace(facts, window_budget=None)):
        got = decode_facts(unpack(pack(encode_facts(sent))))
        assert got == sent
    assert decode_facts(unpack(pack(encode_facts(facts)))).window_budget.refusal(60) is not None
