"""What crosses between the engine core process and its client (engine/core_process.py), as msgpack: prepared
requests, the named queries' answers, and each step's `StepOutputs` as one message whose dense columns travel as
bytes (int32 / float64 arrays), its sparse ones as (row, value) pairs.

Every message is a list whose first element names it:

    client -> core   ["add", call, sink, [request, ...]]     ["abort", request_id, index]
                     ["query", call, name, [arg, ...]]       ["stop"]
    core -> client   ["ready", facts]    ["failed", traceback]    ["dead", message]
                     ["step", sink, step_outputs]     ["fail", sink, message]     ["stats", [value, ...]]
                     ["reply", call, true, result]    ["reply", call, false, error class, message]
"""
from __future__ import annotations

import dataclasses
import math
from array import array
from itertools import chain
from typing import Any

import msgpack

from engine import errors
from engine.core_client import EngineFacts
from engine.kv_blocks import CachedPrefix
from engine.outputs import DraftStats, FinishReason, RequestTimings, SchedulerStats, SequenceInfo, StepOutputs, \
    TokenLogprobs
from engine.requests import EngineRequest
from engine.retention import CachePin, Retention
from engine.sampling_params import SamplingParams, StructuredOutputSpec

_PARAMS = [f.name for f in dataclasses.fields(SamplingParams)]
_NAN = float("nan")


def pack(message: list) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack(data: bytes) -> list:
    return msgpack.unpackb(data, raw=False)


# ---- requests -------------------------------------------------------------------------------------------------------
def encode_request(request: EngineRequest) -> list:
    params = [getattr(request.params, name) for name in _PARAMS]
    spec = request.params.structured_output
    params[_PARAMS.index("structured_output")] = None if spec is None else [spec.kind, spec.value]
    retention = request.retention
    kept = None if retention is None else [[[p.num_tokens, p.ttl_s] for p in retention.pins],
                                           retention.hold_after_finish_s, list(retention.snapshot_hints)]
    return [request.request_id, array("i", request.prompt_token_ids).tobytes(), params, request.cache_salt, kept,
            request.block_hashes]


def decode_request(fields: list) -> EngineRequest:
    request_id, prompt, params, cache_salt, kept, block_hashes = fields
    values = dict(zip(_PARAMS, params))
    if values["structured_output"] is not None:
        values["structured_output"] = StructuredOutputSpec(*values["structured_output"])
    retention = None if kept is None else Retention(tuple(CachePin(n, ttl) for n, ttl in kept[0]), kept[1],
                                                    tuple(kept[2]))
    return EngineRequest(request_id, array("i", prompt).tolist(), SamplingParams(**values), cache_salt, retention,
                         block_hashes)


# ---- step outputs ---------------------------------------------------------------------------------------------------
def _logprobs(entries: list[TokenLogprobs | None]) -> list:
    return [None if e is None else [e.token_id, e.logprob, e.top, e.rank] for e in entries]


def _token_logprobs(entries: list) -> list[TokenLogprobs | None]:
    return [None if e is None else TokenLogprobs(e[0], e[1], [tuple(t) for t in e[2]], e[3]) for e in entries]


def _time(value: float | None) -> float:
    return _NAN if value is None else value


def _maybe(value: float) -> float | None:
    return None if math.isnan(value) else value


def encode_step(out: StepOutputs) -> list:
    infos = out.infos
    counts = array("i", [info.num_prompt_tokens for info in infos])
    counts.extend(info.num_cached_tokens for info in infos)
    counts.extend(info.num_host_cached_tokens for info in infos)
    counts.extend(info.num_disk_cached_tokens for info in infos)
    times = array("d", [t.arrival for t in (info.timings for info in infos)])
    for name in ("scheduled", "first_token", "finished"):
        times.extend(_time(getattr(info.timings, name)) for info in infos)
    return [
        out.request_ids, array("i", out.indices).tobytes(), array("i", map(len, out.new_token_ids)).tobytes(),
        array("i", chain.from_iterable(out.new_token_ids)).tobytes(), counts.tobytes(), times.tobytes(),
        [[row, reason.value] for row, reason in out.finish_reasons.items()],
        list(out.errors.items()),
        [[row, _logprobs(entries)] for row, entries in out.logprobs.items()],
        [[row, _logprobs(entries)] for row, entries in out.prompt_logprobs.items()],
        [[row, dataclasses.astuple(stats)] for row, stats in out.speculation.items()],
    ]


def decode_step(fields: list) -> StepOutputs:
    (request_ids, indices, lengths, flat, counts, times, reasons, errors_, logprobs, prompt_logprobs,
     speculation) = fields
    n = len(request_ids)
    tokens = array("i", flat).tolist()
    new_token_ids, start = [], 0
    for length in array("i", lengths):
        new_token_ids.append(tokens[start:start + length])
        start += length
    c = array("i", counts).tolist()
    t = array("d", times).tolist()
    infos = [SequenceInfo(c[i], c[n + i], c[2 * n + i], c[3 * n + i],
                          RequestTimings(t[i], _maybe(t[n + i]), _maybe(t[2 * n + i]), _maybe(t[3 * n + i])))
             for i in range(n)]
    return StepOutputs(
        request_ids, array("i", indices).tolist(), new_token_ids, infos,
        finish_reasons={row: FinishReason(reason) for row, reason in reasons},
        errors=dict(errors_),
        logprobs={row: _token_logprobs(entries) for row, entries in logprobs},
        prompt_logprobs={row: _token_logprobs(entries) for row, entries in prompt_logprobs},
        speculation={row: DraftStats(*stats) for row, stats in speculation},
    )


# ---- facts, query results, errors -----------------------------------------------------------------------------------
def encode_facts(facts: EngineFacts) -> dict:
    return dataclasses.asdict(facts)


def decode_facts(fields: dict) -> EngineFacts:
    return EngineFacts(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})


def encode_result(query: str, value: Any) -> Any:
    if query == "stats":
        return dataclasses.astuple(value)
    if query == "largest_prefixes":
        prefixes, now = value
        return [[[list(p.block_hashes), p.num_referenced, p.num_retained, p.retained_until] for p in prefixes], now]
    return value


def decode_result(query: str, value: Any) -> Any:
    if query == "stats":
        return SchedulerStats(*value)
    if query == "largest_prefixes":
        prefixes, now = value
        return [CachedPrefix(tuple(hashes), *rest) for hashes, *rest in prefixes], now
    if query == "blocks_now":
        return tuple(value)
    return value


def decode_error(name: str, message: str) -> Exception:
    """The core's exception as the client raises it: the engine's own error classes (a `RequestRejected` is a 400)
    keep their class; anything else is a RuntimeError naming it."""
    cls = getattr(errors, name, None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        return cls(message)
    return RuntimeError(f"{name}: {message}")
