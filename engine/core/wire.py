"""What crosses between the engine core process and its client (engine/core/process.py), as msgpack: prepared
requests, the named queries' answers, and each step's `StepOutputs` as one message whose dense columns travel as
bytes (int32 / float64 arrays), its sparse ones as (row, value) pairs.

Every message is a list whose first element names it:

    client -> core   ["add", call, sink, [request, ...], [grammar JSON or None, ...]]     ["abort", request_id, index]
                     ["query", call, name, [arg, ...]]       ["stop"]
    core -> client   ["ready", facts]    ["failed", traceback]    ["dead", message]
                     ["step", sink, step_outputs (StepEncoder)]     ["fail", sink, message]
                     ["stats", [value, ...]]
                     ["reply", call, true, result]    ["reply", call, false, error class, message]
"""
from __future__ import annotations

import dataclasses
import math
from array import array
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np

from engine import errors
from engine.core.api import EngineFacts
from engine.kv.blocks import CachedPrefix
from engine.kv.window_pool import WindowBudget
from engine.multimodal import ImageInput
from engine.phase_budget import PhaseBudget
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
    budget = request.params.phase_budget
    params[_PARAMS.index("phase_budget")] = None if budget is None else dataclasses.astuple(budget)
    retention = request.retention
    kept = None if retention is None else [[[p.num_tokens, p.ttl_s] for p in retention.pins],
                                           retention.hold_after_finish_s, list(retention.snapshot_hints),
                                           retention.tenant]
    return [request.request_id, array("i", request.prompt_token_ids).tobytes(), params, request.cache_salt, kept,
            request.block_hashes, encode_images(request.images)]


def encode_images(images: tuple[ImageInput, ...]) -> list:
    return [[i.content_hash, list(i.grid_thw), i.merge_size, i.offset, list(i.pixel_values.shape),
             i.pixel_values.tobytes(), i.mrope, i.bidirectional] for i in images]


def decode_images(fields: list) -> tuple[ImageInput, ...]:
    return tuple(ImageInput(content_hash, tuple(grid), merge_size, offset,
                            np.frombuffer(pixels, dtype=np.float32).reshape(shape), mrope, bidirectional)
                 for content_hash, grid, merge_size, offset, shape, pixels, mrope, bidirectional in fields)


def decode_request(fields: list) -> EngineRequest:
    request_id, prompt, params, cache_salt, kept, block_hashes, images = fields
    values = dict(zip(_PARAMS, params))
    if values["structured_output"] is not None:
        values["structured_output"] = StructuredOutputSpec(*values["structured_output"])
    if values["phase_budget"] is not None:
        budget, forced, end, start, open_at_start = values["phase_budget"]
        values["phase_budget"] = PhaseBudget(budget, tuple(forced), tuple(end), tuple(start), open_at_start)
    retention = None if kept is None else Retention(tuple(CachePin(n, ttl) for n, ttl in kept[0]), kept[1],
                                                    tuple(kept[2]), kept[3])
    return EngineRequest(request_id, array("i", prompt).tolist(), SamplingParams(**values), cache_salt, retention,
                         block_hashes, decode_images(images))


# ---- step outputs ---------------------------------------------------------------------------------------------------
def _logprobs(entries: list[TokenLogprobs | None]) -> list:
    return [None if e is None else [e.token_id, e.logprob, e.top, e.rank] for e in entries]


def _token_logprobs(entries: list) -> list[TokenLogprobs | None]:
    return [None if e is None else TokenLogprobs(e[0], e[1], [tuple(t) for t in e[2]], e[3]) for e in entries]


def _time(value: float | None) -> float:
    return _NAN if value is None else value


def _maybe(value: float) -> float | None:
    return None if math.isnan(value) else value


def _info_columns(infos: list[SequenceInfo]) -> tuple[bytes, bytes]:
    counts = array("i", [info.num_prompt_tokens for info in infos])
    counts.extend(info.num_cached_tokens for info in infos)
    counts.extend(info.num_host_cached_tokens for info in infos)
    counts.extend(info.num_disk_cached_tokens for info in infos)
    counts.extend(info.num_pinned_tokens for info in infos)
    times = array("d", [info.timings.arrival for info in infos])
    for name in ("scheduled", "first_token", "finished"):
        times.extend(_time(getattr(info.timings, name)) for info in infos)
    return counts.tobytes(), times.tobytes()


def _infos(counts: bytes, times: bytes) -> list[SequenceInfo]:
    c, t = array("i", counts).tolist(), array("d", times).tolist()
    n = len(c) // 5
    return [SequenceInfo(c[i], c[n + i], c[2 * n + i], c[3 * n + i],
                         RequestTimings(t[i], _maybe(t[n + i]), _maybe(t[2 * n + i]), _maybe(t[3 * n + i])),
                         c[4 * n + i])
            for i in range(n)]


class StepEncoder:
    """The core's side of one sink's steps. A sequence's `SequenceInfo` (prompt length, cached tokens, timings)
    travels with its first row and its last only, so a steady decode row carries its tokens alone: the encoder
    remembers what the decoder holds, and every ``PRUNE_EVERY`` steps tells it which requests are gone for good
    (aborted ones end without a last row). ``is_live``: whether the engine still runs a request (engine thread)."""

    PRUNE_EVERY = 64

    def __init__(self, is_live: Callable[[str], bool]) -> None:
        self.is_live = is_live
        self.known: dict[str, set[int]] = {}  # request id -> indices of its sequences the decoder has an info of
        self._steps = 0

    def encode(self, out: StepOutputs) -> list:
        known, finished, request_ids = self.known, out.finish_reasons, out.request_ids
        info_rows = []
        for row, (request_id, index) in enumerate(zip(request_ids, out.indices)):
            indices = known.get(request_id)
            if indices is None:
                indices = known[request_id] = set()
            if index not in indices:
                indices.add(index)
                info_rows.append(row)
            elif row in finished:  # its final timings
                info_rows.append(row)
        for row in finished:
            indices = known[request_ids[row]]
            indices.discard(out.indices[row])
            if not indices:
                del known[request_ids[row]]
        gone: list[str] = []
        self._steps += 1
        if self._steps % self.PRUNE_EVERY == 0:
            gone = [request_id for request_id in known if not self.is_live(request_id)]
            for request_id in gone:
                del known[request_id]
        counts, times = _info_columns([out.infos[row] for row in info_rows])
        return [
            request_ids, array("i", out.indices).tobytes(), out.num_tokens.astype(np.int32).tobytes(),
            out.token_ids.astype(np.int32).tobytes(),
            array("i", info_rows).tobytes(), counts, times, gone,
            [[row, reason.value] for row, reason in finished.items()],
            list(out.errors.items()),
            [[row, _logprobs(entries)] for row, entries in out.logprobs.items()],
            [[row, _logprobs(entries)] for row, entries in out.prompt_logprobs.items()],
            [[row, dataclasses.astuple(stats)] for row, stats in out.speculation.items()],
        ]


class StepDecoder:
    """The client's side of one sink's steps: a `StepEncoder`'s messages back into `StepOutputs`, each row with its
    sequence's `SequenceInfo` (kept from the sequence's first row until its last)."""

    def __init__(self) -> None:
        self.infos: dict[str, dict[int, SequenceInfo]] = {}

    def decode(self, fields: list) -> StepOutputs:
        (request_ids, indices, num_tokens, token_ids, info_rows, counts, times, gone, reasons, errors_, logprobs,
         prompt_logprobs, speculation) = fields
        indices = array("i", indices).tolist()
        known = self.infos
        for row, info in zip(array("i", info_rows), _infos(counts, times)):
            by_index = known.get(request_ids[row])
            if by_index is None:
                by_index = known[request_ids[row]] = {}
            by_index[indices[row]] = info
        infos = [known[request_id][index] for request_id, index in zip(request_ids, indices)]
        finish_reasons = {row: FinishReason(reason) for row, reason in reasons}
        for row in finish_reasons:
            by_index = known[request_ids[row]]
            del by_index[indices[row]]
            if not by_index:
                del known[request_ids[row]]
        for request_id in gone:
            known.pop(request_id, None)
        out = StepOutputs(request_ids, indices, np.frombuffer(token_ids, dtype=np.int32),
                          np.frombuffer(num_tokens, dtype=np.int32), infos)
        out.finish_reasons, out.errors = finish_reasons, dict(errors_)
        out.logprobs = {row: _token_logprobs(entries) for row, entries in logprobs}
        out.prompt_logprobs = {row: _token_logprobs(entries) for row, entries in prompt_logprobs}
        out.speculation = {row: DraftStats(*stats) for row, stats in speculation}
        return out


# ---- facts, query results, errors -----------------------------------------------------------------------------------
def encode_facts(facts: EngineFacts) -> dict:
    return dataclasses.asdict(facts)


def decode_facts(fields: dict) -> EngineFacts:
    facts = EngineFacts(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})
    budget = fields.get("window_budget")  # asdict flattened the nested dataclass: the preparer calls its methods
    return dataclasses.replace(facts, window_budget=WindowBudget(**budget)) if budget is not None else facts


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
