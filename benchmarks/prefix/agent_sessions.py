"""Concurrent agent sessions with tool-call gaps, under memory pressure: the workload where LRU alone fails agents.

Every session is the same agent (one shared system prompt and tool list) on its own task: turn 0 sends the shared
prefix and the task; each later turn appends the model's reply and what came back: mostly a tool call and the
tool's result, after a gap while the tool runs (log-normal: mostly seconds, sometimes a minute); sometimes a final
answer, and the user's next message after a longer human gap. Sessions start spread over a window and interleave.
While a session waits on its tool, the others' turns push its blocks out of a device pool too small for all of
them: LRU evicts the session idle the longest, which is the one about to come back, and keeps those waiting on a
human just as well. Session retention (a hold across tool calls only), a host tier (copy back instead of
recompute), or both, keep it.

Token ids are drawn at random (the engine takes token prompts), so no tokenizer is needed and any size runs.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from engine.retention import CachePin

from benchmarks.prefix.traces.trace import TokenRequest


@dataclass(frozen=True)
class SessionsParams:
    sessions: int = 8
    turns: int = 5
    shared_tokens: int = 600  # the agent's system prompt and tools, the same in every session
    task_tokens: int = 150
    result_tokens: tuple[int, int] = (50, 300)  # a tool result, uniform in this range
    reply_tokens: tuple[int, int] = (20, 60)  # the model's tool call (scripted: later turns carry it)
    tool_gap_median_s: float = 8.0  # log-normal gap between a tool call and the turn with its result
    tool_gap_sigma: float = 1.0
    human_turn_fraction: float = 0.25  # replies that are a final answer: the user writes next
    human_gap_median_s: float = 90.0  # log-normal (same sigma)
    start_window_s: float = 30.0  # sessions start uniformly within it
    pin_shared: bool = False  # a cache_control breakpoint after the shared prefix (5 minutes)
    vocab: int = 150_000
    seed: int = 0


def agent_sessions(params: SessionsParams) -> list[TokenRequest]:
    """The requests, turn-major (every session's turn 0, then every turn 1, ...): parents before children, and
    among ready requests the earlier turns first."""
    rng = random.Random(params.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, params.vocab) for _ in range(n)]

    shared = tokens(params.shared_tokens)
    pins = (CachePin(params.shared_tokens, 300.0),) if params.pin_shared else ()
    by_turn: list[list[TokenRequest]] = [[] for _ in range(params.turns)]
    for s in range(params.sessions):
        prompt = shared + tokens(params.task_tokens)
        parent = None
        start = rng.uniform(0, params.start_window_s)
        gap = 0.0
        for turn in range(params.turns):
            tool_call = turn < params.turns - 1 and rng.random() >= params.human_turn_fraction
            request = TokenRequest(
                request_id=f"s{s}-t{turn}", session=f"s{s}", prompt=list(prompt),
                output=tokens(rng.randint(*params.reply_tokens)), parent=parent, turn=turn,
                arrival=start if parent is None else 0, think_s=gap, ends_in_tool_call=tool_call, pins=pins,
                snapshot_hints=(params.shared_tokens,),  # where the server hints a hybrid model's snapshot
            )
            by_turn[turn].append(request)
            prompt = prompt + request.output + tokens(rng.randint(*params.result_tokens))
            parent = request.request_id
            median = params.tool_gap_median_s if tool_call else params.human_gap_median_s
            gap = rng.lognormvariate(0, params.tool_gap_sigma) * median
    return [r for turn in by_turn for r in turn]
